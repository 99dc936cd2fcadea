"""Whether a checkpoint still holds what its manifest (`gangrun.checkpoint.manifest`) records.

A listing of the checkpoint's files, compared with its manifest: a file missing, or of another
size, makes the checkpoint *damaged*. That catches truncation (a partial upload, a full disk, an
interrupted copy) and deletion without reading a byte. ``checksums=True`` also reads every
file and compares its CRC-32 (silent corruption of the same size), at the cost of reading
the whole checkpoint. A marker without a manifest (written by an older gangrun) is *complete
but unverifiable*: taken as valid. A marker that cannot be used (empty, not JSON, a manifest
whose sizes are not numbers) makes the checkpoint *damaged*, for the listing and the restore
alike.

A ``Checkpointer`` restores the newest valid checkpoint (`choose`, on rank 0), warning about
each damaged one it skips; `load` raises `DamagedCheckpointError` (`check_before_load`, and
the reader's own failures, named by file).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

from . import (
    MARKER,
    DamagedCheckpointError,
    filesystem,
    invalidate_listing,
    list_checkpoints,
    natural_key,
    public_path,
    stored_time,
)
from .manifest import FILES, crc32_of, files_under, read_marker

_METADATA = ".metadata"


@dataclass
class Problem:
    """One thing wrong with a checkpoint: ``kind`` is ``missing``, ``size``, ``checksum``,
    ``unreadable`` or ``marker``; ``file`` is relative to the checkpoint's directory."""

    file: str
    kind: str
    detail: str

    def __str__(self) -> str:
        return f"{self.file} {self.detail}"


@dataclass
class CheckpointReport:
    """A checkpoint directory and what verifying it found.

    ``state``: ``complete`` (its marker and, when the marker holds a manifest, every file
    as recorded), ``damaged`` (a marker, but ``problems``), ``partial`` (no marker: its save
    never finished). ``verified`` is False for a marker without a manifest (complete but
    unverifiable); ``checksums`` whether CRC-32s were compared; ``size`` the bytes stored;
    ``time`` the commit time (for a partial one, its newest file's, when the storage says).
    """

    url: str
    name: str
    step: int | None
    state: str
    verified: bool = False
    checksums: bool = False
    problems: list[Problem] = field(default_factory=list)
    size: int = 0
    files: int = 0
    time: float | None = None

    @property
    def ok(self) -> bool:
        return self.state == "complete"

    @property
    def reason(self) -> str:
        """Why it is not complete ("" when it is)."""
        if self.state == "partial":
            return f"no {MARKER} marker: its save did not finish"
        shown = "; ".join(str(p) for p in self.problems[:3])
        more = len(self.problems) - 3
        return shown + (f" (and {more} more)" if more > 0 else "")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"], d["reason"] = self.ok, self.reason
        return d


def _step(name: str) -> int | None:
    m = re.search(r"(\d+)$", name)
    return int(m.group(1)) if m else None


@dataclass
class _Entry:
    """A checkpoint directory of a listing, before its files are compared."""

    url: str
    name: str
    path: str
    files: dict[str, dict[str, Any]]
    marker: dict[str, Any] | None  # None: no marker; {"": "..."}: unreadable
    time: float | None

    def check(self, fs: Any, checksums: bool) -> CheckpointReport:
        sizes = {rel: int(info.get("size") or 0) for rel, info in self.files.items()}
        rep = CheckpointReport(
            self.url,
            self.name,
            _step(self.name),
            "partial" if self.marker is None else "complete",
            size=sum(sizes.values()),
            files=len(sizes),
            time=self.time,
        )
        if self.marker is None:
            return rep
        if "" in self.marker:
            rep.problems.append(Problem(MARKER, "marker", str(self.marker[""])))
        recorded = self.marker.get(FILES)
        if isinstance(recorded, dict):
            rep.verified, rep.checksums = True, checksums
            for rel, want in sorted(recorded.items(), key=lambda kv: natural_key(kv[0])):
                want = want if isinstance(want, dict) else {}
                try:
                    size = int(want.get("size", -1))
                except (TypeError, ValueError):  # a manifest that cannot be trusted
                    what = f"records a size that is not a number for {rel}: {want['size']!r}"
                    rep.problems.append(Problem(MARKER, "marker", what))
                    continue
                if rel not in sizes:
                    rep.problems.append(Problem(rel, "missing", f"is missing ({size} bytes)"))
                elif sizes[rel] != size:
                    what = "truncated" if sizes[rel] < size else "longer than recorded"
                    rep.problems.append(
                        Problem(rel, "size", f"is {what}: {sizes[rel]} bytes, {size} recorded")
                    )
                elif checksums and want.get("crc32"):
                    try:
                        got = crc32_of(fs, f"{self.path}/{rel}")
                    except OSError as exc:
                        rep.problems.append(Problem(rel, "unreadable", f"cannot be read: {exc}"))
                        continue
                    if got != want["crc32"]:
                        rep.problems.append(
                            Problem(rel, "checksum", f"has CRC-32 {got}, {want['crc32']} recorded")
                        )
        if rep.problems:
            rep.state = "damaged"
        return rep


def _entries(
    url: str | os.PathLike[str], storage_options: dict[str, Any]
) -> tuple[Any, list[_Entry]]:
    """The checkpoint-like directories directly under ``url`` (one listing, one read per
    marker), oldest first: by commit time, then name; partial ones by name, last."""
    src = os.fspath(url)
    fs, root = filesystem(src, storage_options)
    root = root.rstrip("/")
    invalidate_listing(fs, root)
    by_dir: dict[str, dict[str, dict[str, Any]]] = {}
    for rel, info in files_under(fs, root).items():
        if "/" in rel:
            name, inner = rel.split("/", 1)
            by_dir.setdefault(name, {})[inner] = info
    out = []
    for name, files in by_dir.items():
        looks = (
            MARKER in files
            or _METADATA in files
            or any(f.endswith(".distcp") or f.startswith("deepspeed/") for f in files)
        )
        if not looks:
            continue
        path = f"{root}/{name}"
        marker = read_marker(fs, f"{path}/{MARKER}") if MARKER in files else None
        t: float | None
        if marker is not None:
            try:
                t = float(marker["time"])
            except (KeyError, TypeError, ValueError):  # a marker that records no time
                t = stored_time(files[MARKER]) or 0.0
        else:
            times = [m for m in (stored_time(i) for i in files.values()) if m is not None]
            t = max(times) if times else None
        data = {k: v for k, v in files.items() if k != MARKER}
        out.append(_Entry(public_path(fs, src, path), name, path, data, marker, t))
    out.sort(key=lambda e: (e.marker is None, e.time or 0.0, natural_key(e.name)))
    return fs, out


def verify(
    url: str | os.PathLike[str], *, checksums: bool = False, **storage_options: Any
) -> CheckpointReport:
    """Verify checkpoint ``url`` against the manifest of its marker: every file there, of its
    recorded size (and CRC-32 with ``checksums=True``: reads every byte). The report's
    ``problems`` list what is wrong; ``ok`` whether it is complete."""
    src = os.fspath(url).rstrip("/")
    fs, path = filesystem(src, storage_options)
    path = path.rstrip("/")
    invalidate_listing(fs, path)
    files = files_under(fs, path)
    marker = read_marker(fs, f"{path}/{MARKER}") if MARKER in files else None
    t = None
    if marker is not None and "" not in marker:
        with contextlib.suppress(TypeError, ValueError):
            t = float(marker.get("time", 0.0))
    data = {k: v for k, v in files.items() if k != MARKER}
    name = path.rsplit("/", 1)[-1]
    return _Entry(public_path(fs, src, path), name, path, data, marker, t).check(fs, checksums)


def scan(
    url: str | os.PathLike[str], *, checksums: bool = False, **storage_options: Any
) -> list[CheckpointReport]:
    """Every checkpoint directly under location ``url`` (complete, damaged, partial), verified;
    ordered by name (numbers compared as numbers)."""
    fs, entries = _entries(url, storage_options)
    reports = [e.check(fs, checksums) for e in entries]
    return sorted(reports, key=lambda r: natural_key(r.name))


def newest_valid(
    url: str | os.PathLike[str], *, checksums: bool = False, **storage_options: Any
) -> tuple[str | None, list[CheckpointReport]]:
    """(the newest complete checkpoint under ``url`` that verifies, or None; the damaged ones
    newer than it, newest first, that were skipped). "Newest" as in `latest`.

    Lists the markers, then each candidate's files, newest first, until one verifies: a
    restore lists one checkpoint's files, not the whole location's."""
    skipped: list[CheckpointReport] = []
    for found in reversed(list_checkpoints(url, **storage_options)):
        rep = verify(found, checksums=checksums, **storage_options)
        if rep.ok:
            return rep.url, skipped
        skipped.append(rep)
    return None, skipped


# ---------------------------------------------------------------------- restore's choice
def no_valid_message(location: str, damaged: list[CheckpointReport]) -> str:
    """Why nothing can be restored from ``location``: every complete checkpoint is damaged."""
    newest = damaged[0]
    older = len(damaged) - 1
    also = f"; the {older} older one{'s are' if older > 1 else ' is'} damaged too" if older else ""
    return (
        f"no valid checkpoint in {location}: the newest, {newest.url}, is damaged "
        f"({newest.reason}){also}. Nothing was restored (starting at step 0 would silently "
        f"redo the training). See `gangrun checkpoints {location}`; restore the files from a "
        "copy, delete the damaged checkpoints to fall back to an older one (or to start "
        "over), or name another checkpoint location."
    )


@dataclass
class Choice:
    """Rank 0's decision of what to restore, sent to every rank."""

    url: str | None = None
    error: str | None = None


def choose(location: str, **storage_options: Any) -> Choice:
    """The newest valid checkpoint of ``location``, warning (stderr and `warnings.warn`)
    about each damaged one skipped; an error when there are complete ones but none valid."""
    found, skipped = newest_valid(location, **storage_options)
    if found is None and skipped:
        return Choice(error=f"Checkpointer: {no_valid_message(location, skipped)}")
    for rep in skipped:
        msg = (
            f"gangrun: checkpoint {rep.url} is damaged ({rep.reason}): skipped; restoring "
            f"{found} instead."
        )
        print(msg, file=sys.stderr, flush=True)
        warnings.warn(msg, DamagedCheckpointWarning, stacklevel=3)
    return Choice(url=found)


def chosen(choice: Any) -> str | None:
    """The checkpoint to restore from rank 0's `Choice` (raises its error on every rank)."""
    if isinstance(choice, Choice):
        if choice.error:
            raise RuntimeError(choice.error)
        return choice.url
    return choice


class DamagedCheckpointWarning(UserWarning):
    """A damaged checkpoint was skipped for an older, valid one."""


# ---------------------------------------------------------------------- load's errors
_READ_ERRORS = ("PytorchStreamReader", "PyTorchStreamReader", "central directory", "EOF")


def is_read_error(exc: BaseException) -> bool:
    """Whether ``exc``, raised while torch read a checkpoint file, says the file is bad (not
    that the state does not match it)."""
    import pickle
    import zipfile

    if isinstance(exc, (EOFError, pickle.UnpicklingError, zipfile.BadZipFile, OSError)):
        return True
    return isinstance(exc, RuntimeError) and any(s in str(exc) for s in _READ_ERRORS)


def damaged_file(url: str, rel: str, exc: BaseException, storage_options: dict[str, Any]) -> str:
    """The message of a file torch could not read (its CRC-32 compared when recorded)."""
    said = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    said = said.split(". ", 1)[0][:300]  # torch's first sentence says it; the rest is advice
    detail = f"could not be read ({type(exc).__name__}{': ' + said if said else ''})"
    with contextlib.suppress(Exception):
        fs, path = filesystem(url, storage_options)
        path = path.rstrip("/")
        want = (read_marker(fs, f"{path}/{MARKER}").get(FILES) or {}).get(rel) or {}
        if want.get("crc32"):
            got = crc32_of(fs, f"{path}/{rel}")
            if got != want["crc32"]:
                detail += f"; its CRC-32 is {got}, {want['crc32']} recorded"
    return damaged_message(url, f"{rel} {detail}")


def damaged_message(url: str, what: str) -> str:
    root = os.fspath(url).rstrip("/").rsplit("/", 1)[0]
    return (
        f"checkpoint {url} is damaged: {what}. Use gangrun.checkpoint.newest_valid({root!r}) "
        f"for the newest valid one (`gangrun checkpoints {root}` lists them all)."
    )


def check_before_load(url: str, storage_options: dict[str, Any]) -> None:
    """Raise `DamagedCheckpointError` if ``url``'s files differ from its manifest."""
    rep = verify(url, **storage_options)
    if rep.problems:
        p = rep.problems[0]
        raise DamagedCheckpointError(damaged_message(rep.url, rep.reason), url=rep.url, file=p.file)


__all__ = [
    "CheckpointReport",
    "Choice",
    "DamagedCheckpointWarning",
    "Problem",
    "choose",
    "chosen",
    "newest_valid",
    "no_valid_message",
    "scan",
    "verify",
]
