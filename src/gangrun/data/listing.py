"""Listing the files of a source (local path, glob, fsspec URL), and reading local files.

The listing is sorted, so every rank and every DataLoader worker sees the same list. fsspec is
imported only when `list_files` runs; this module does not import torch.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

GLOB_CHARS = re.compile(r"[*?\[]")
LOCAL_PROTOCOLS = ("file", "local")
O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


@dataclass(frozen=True)
class FileEntry:
    """One listed file: its path on the filesystem, size and a version tag (ETag/mtime)."""

    path: str
    size: int
    version: str


def read_fd(fd: int, size: int | None) -> bytes:
    """The rest of open file ``fd``; with its expected ``size``, in one ``read`` call (asking
    for one byte more, so a longer file is noticed without another call)."""
    if not size:
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    data = os.read(fd, size + 1)
    if len(data) < size:  # reads stop at ~2 GiB, or the file is shorter than listed
        chunks = [data]
        got = len(data)
        while got <= size and (chunk := os.read(fd, size + 1 - got)):
            chunks.append(chunk)
            got += len(chunk)
        data = b"".join(chunks)
    return data


def read_local(entry: FileEntry) -> bytes:
    """A local file's bytes, in one ``read`` call when its size is as listed."""
    fd = os.open(entry.path, os.O_RDONLY | O_CLOEXEC)
    try:
        data = read_fd(fd, entry.size)
        if len(data) > entry.size:  # grew since it was listed
            data += read_fd(fd, None)
    finally:
        os.close(fd)
    return data


def _version(info: dict[str, Any]) -> str:
    for k in ("ETag", "etag", "md5Hash", "mtime", "LastModified", "last_modified", "created"):
        v = info.get(k)
        if v is not None:
            return str(v)
    return ""


def list_files(source: Any, storage_options: dict[str, Any]) -> tuple[str, list[FileEntry], Any]:
    """``(protocol, sorted entries, filesystem)`` of the files under ``source``: a path, glob,
    fsspec URL, or a list of them on one filesystem. Hidden files (``.name``) are skipped."""
    from fsspec.core import url_to_fs

    sources = list(source) if isinstance(source, (list, tuple)) else [source]
    if not sources:
        raise ValueError("VolumeDataset needs a directory, glob, URL or list of files")
    protocol = None
    found: dict[str, dict[str, Any]] = {}
    fs: Any = None
    for src in sources:
        fs, path = url_to_fs(os.fspath(src), **storage_options)
        fs.invalidate_cache()  # a listing cached earlier in this process may be stale
        proto = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        if protocol is None:
            protocol = proto
        elif proto != protocol:
            raise ValueError(f"all sources must be on one filesystem, got {protocol} and {proto}")
        if GLOB_CHARS.search(path):
            infos = fs.glob(path, detail=True)
        elif fs.isdir(path):
            infos = fs.find(path, detail=True)
        elif fs.exists(path):
            infos = {path: fs.info(path)}
        else:
            raise FileNotFoundError(f"VolumeDataset: nothing found at {src!r}")
        for p, info in infos.items():
            if info.get("type", "file") != "file":
                continue
            if os.path.basename(p.rstrip("/")).startswith("."):
                continue  # hidden files: .DS_Store, partial uploads, ...
            found[p] = info
    entries = [
        FileEntry(p, int(found[p].get("size") or 0), _version(found[p])) for p in sorted(found)
    ]
    return str(protocol), entries, fs


__all__ = ["FileEntry", "LOCAL_PROTOCOLS", "list_files", "read_fd", "read_local"]
