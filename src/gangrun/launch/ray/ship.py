"""Environment synchronisation: what a Ray call ships from the caller to the nodes; the one
owner of shipping code to Ray nodes, and of every private Ray name it takes.

Why not Ray's ``working_dir`` as is: Ray computes a directory's package URI by reading and
hashing every file of it on each upload (``get_uri_for_directory``), every call, and ships
one directory (not the local ``sys.path`` entries a notebook's modules come from). Here the
caller keeps each file's (size, mtime, inode) from the last hash, so an unchanged project
costs one ``stat`` per file and one GCS lookup per package: measured on a two-raylet cluster
(docs/benchmarks.md, "Ray clusters"), a 50 MB project's first call started in 9.1 s, each
unchanged call after it in 6.0 s (shipping off: 3.3 s, the rest is Ray's actor start), and
it was uploaded 0 more times. A ``working_dir`` or ``py_modules`` the user names in the
runtime env is uploaded with Ray's own functions, as ``ray.init`` does
(`upload_runtime_env`): the user chose Ray's behaviour for it.

By default (``RayOptions(ship=True)``) a call ships the caller's working directory and the
local ``sys.path`` entries the function's modules come from (not site-packages, not the
standard library, not gangrun itself: nodes run their own installed gangrun, checked by
`versions`). Files ignored by ``.gitignore`` (``git ls-files`` semantics when the
directory is in a git work tree, the ``.gitignore`` files otherwise), ``.git``,
``__pycache__`` and virtual environments are left out, as are ``RayOptions.excludes``.

Each shipped directory ("root") becomes one content-addressed zip, ``gcs://_ray_pkg_<sha>.zip``
(the hash of every file's relative path, mode and content), uploaded to the cluster's GCS
only when it is not there yet, and handed to the rank actors as a Ray ``py_modules`` entry:
Ray downloads it once per node and caches it. The caller keeps each file's (size, mtime,
inode) from the last hash, so an unchanged project costs one ``stat`` per file and one GCS
lookup per call. On the node, the actor maps the caller's paths to the shipped copies
(`remote_paths`); ranks on a node that sees the caller's very directory run in it.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import stat
import subprocess
import sys
import threading
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...errors import LaunchError
from ...wire import contract
from ...wire.serialization import human_bytes
from .records import FilesIdentity, ShipMap

log = logging.getLogger("gangrun.launch.ray")
ALWAYS_EXCLUDED = (".git/", "__pycache__/", "*.pyc", ".ipynb_checkpoints/", ".venv/", "venv/")
MAX_FILES = 200_000  # a walk that finds more is refused (a home directory, a dataset)
PKG_PREFIX = "_ray_pkg_gr"  # Ray's package names start with _ray_pkg_; ours are recognisable
_lock = threading.Lock()
# root -> (stat signature of its file set, content hash): an unchanged tree is not re-read
_hashes: dict[str, tuple[tuple, str]] = {}


def _ray_private(module: str, name: str) -> Any:
    """``name`` of Ray's private ``module`` (the guard names the supported Ray versions when
    it moved): gangrun takes private Ray names here only."""
    from ..._compat_imports import RAY_SUPPORTED, private_import

    return private_import(f"ray._private.{module}", name, supported=RAY_SUPPORTED)


@dataclass(frozen=True)
class Root:
    """One shipped directory: the caller's path, its files, the package URI."""

    path: str
    files: tuple[tuple[str, int], ...]  # (relative path, size)
    uri: str

    @property
    def name(self) -> str:
        """The directory name the package gets on a node (Ray's local dir for the URI)."""
        return self.uri.split("://", 1)[1].removesuffix(".zip")

    @property
    def size(self) -> int:
        return sum(s for _, s in self.files)


@dataclass
class Manifest:
    """What one call ships: the caller's working directory and the other roots."""

    cwd: str  # "" when the cwd is not shipped
    roots: list[Root] = field(default_factory=list)

    def context(self) -> ShipMap:
        """What the rank actors need to map paths."""
        return ShipMap(self.cwd, tuple((r.path, r.name) for r in self.roots))

    def shipped(self, path: str) -> bool:
        """Whether the caller's file ``path`` is in a shipped root."""
        path = os.path.abspath(path)
        for r in self.roots:
            if path.startswith(r.path.rstrip("/") + "/"):
                rel = os.path.relpath(path, r.path)
                return any(f == rel for f, _ in r.files)
        return False

    def root_of(self, path: str) -> Root | None:
        path = os.path.abspath(path)
        for r in self.roots:
            if path == r.path or path.startswith(r.path.rstrip("/") + "/"):
                return r
        return None


def files_identity(path: str) -> FilesIdentity:
    """Who sees this directory: boot id, device and inode (equal on a node that shares the
    caller's filesystem view, different where the directory is another one or absent)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    try:
        st = os.stat(path)
    except OSError:
        return FilesIdentity(boot)
    return FilesIdentity(boot, st.st_dev, st.st_ino)


def sees_caller_files(caller: FilesIdentity | None, cwd: str) -> bool:
    """On a rank's node: is the caller's working directory this very directory here?"""
    if caller is None:
        return os.path.isdir(cwd)
    return files_identity(cwd) == caller and caller.ino != -1


# ------------------------------------------------------------------ which roots
def _system_dirs() -> list[str]:
    import site
    import sysconfig

    dirs = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        p = sysconfig.get_paths().get(key)
        if p:
            dirs.add(p)
    try:
        dirs.update(site.getsitepackages())
        dirs.add(site.getusersitepackages())
    except AttributeError:  # a virtualenv's old site module
        log.debug("site.getsitepackages is missing")
    gangrun_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    dirs.add(gangrun_root)
    return [os.path.abspath(d) for d in dirs if d]


def _is_system(path: str, system: Sequence[str]) -> bool:
    p = os.path.abspath(path)
    if "site-packages" in p.split(os.sep) or "dist-packages" in p.split(os.sep):
        return True
    return any(p == d or p.startswith(d.rstrip("/") + "/") for d in system)


def module_roots(modules: Iterable[str], sys_path: Sequence[str], cwd: str) -> list[str]:
    """The local ``sys.path`` entries (outside ``cwd``, which is shipped anyway) that the
    named modules were imported from."""
    system = _system_dirs()
    entries = sorted(
        {os.path.abspath(p or cwd) for p in sys_path if os.path.isdir(p or cwd)},
        key=len,
        reverse=True,
    )
    found: list[str] = []
    for name in modules:
        mod = sys.modules.get(name)
        origin = getattr(mod, "__file__", None) if mod is not None else None
        if not origin:
            continue
        origin = os.path.abspath(origin)
        for entry in entries:  # the longest entry holding the file is where it came from
            if origin.startswith(entry.rstrip("/") + "/"):
                if entry not in found and not _is_system(entry, system):
                    found.append(entry)
                break
    inside = cwd.rstrip("/") + "/"
    return [r for r in found if r != cwd and not r.startswith(inside)]


def pickled_modules(payload: bytes, limit: int = 64 << 20) -> set[str]:
    """Module names a cloudpickle payload refers to (functions, classes and modules pickled by
    reference): every string in the pickle that names a loaded module. Payloads larger than
    ``limit`` are not scanned (their by-reference modules still ship with the cwd)."""
    import pickletools

    names: set[str] = set()
    if len(payload) > limit:
        return names
    try:
        for op, arg, _ in pickletools.genops(payload):
            if isinstance(arg, str) and arg in sys.modules:
                names.add(arg)
            elif op.name in ("GLOBAL", "INST") and isinstance(arg, str):
                names.add(arg.split(" ", 1)[0])
    except Exception as exc:  # a payload pickletools cannot walk: ship the cwd only
        log.debug("scanning the payload for modules: %s", exc)
    return {n.split(".", 1)[0] for n in names} | names


# ------------------------------------------------------------------ file sets
def _spec(lines: Iterable[str]) -> Any:
    try:
        import pathspec

        spec: Any = pathspec.PathSpec
    except ImportError:  # Ray vendors it
        spec = _ray_private("thirdparty.pathspec", "PathSpec")
    return spec.from_lines("gitwildmatch", list(lines))


def _git_files(root: str) -> list[str] | None:
    try:
        out = subprocess.run(
            ["git", "-C", root, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            capture_output=True,
            timeout=60,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [p for p in out.decode("utf-8", "surrogateescape").split("\0") if p]


def _walk_files(root: str) -> list[str]:
    """Every file under ``root`` not ignored by the ``.gitignore`` files on the way."""
    out: list[str] = []
    stack: list[tuple[str, list[tuple[str, Any]]]] = [("", [])]
    while stack:
        rel, specs = stack.pop()
        here = os.path.join(root, rel)
        gi = os.path.join(here, ".gitignore")
        if os.path.isfile(gi):
            with open(gi, errors="replace") as f:
                specs = [*specs, (rel, _spec(f))]
        try:
            entries = list(os.scandir(here))
        except OSError:
            continue
        for e in entries:
            path = os.path.join(rel, e.name)
            is_dir = e.is_dir(follow_symlinks=False)
            if is_dir and os.path.exists(os.path.join(e.path, "pyvenv.cfg")):
                continue  # a virtual environment
            test = path + "/" if is_dir else path
            if any(sp.match_file(os.path.relpath(test, base or ".")) for base, sp in specs):
                continue
            if is_dir:
                stack.append((path, specs))
            elif e.is_file():
                out.append(path)
        if len(out) > MAX_FILES:
            raise LaunchError(
                f"backend='ray' ships the working directory to the cluster's nodes, but "
                f"{root} holds more than {MAX_FILES} files. Start from your project's folder, "
                "exclude the rest (.gitignore, ray=gangrun.RayOptions(excludes=[...])), or turn "
                "shipping off with RayOptions(ship=False)."
            )
    return out


def list_files(root: str, excludes: Sequence[str] = ()) -> list[tuple[str, os.stat_result]]:
    """``(relative path, stat)`` of what ships from ``root`` (sorted)."""
    names = _git_files(root)
    if names is None:
        names = _walk_files(root)
    drop = _spec([*ALWAYS_EXCLUDED, *excludes])
    out = []
    for rel in names:
        if drop.match_file(rel):
            continue
        try:
            st = os.stat(os.path.join(root, rel))
        except OSError:
            continue  # deleted but still in git's index
        if stat.S_ISREG(st.st_mode):
            out.append((rel, st))
    out.sort(key=lambda x: x[0])
    return out


def _biggest(files: Sequence[tuple[str, int]], n: int = 5) -> list[tuple[str, int]]:
    per: dict[str, int] = {}
    for rel, size in files:
        top = rel.split("/", 1)[0] + ("/" if "/" in rel else "")
        per[top] = per.get(top, 0) + size
    return sorted(per.items(), key=lambda kv: -kv[1])[:n]


def _content_hash(root: str, files: Sequence[tuple[str, os.stat_result]]) -> str:
    h = hashlib.sha256()
    for rel, st in files:
        h.update(rel.encode("utf-8", "surrogateescape") + b"\0")
        h.update(b"x" if st.st_mode & 0o111 else b"-")
        with open(os.path.join(root, rel), "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        h.update(b"\0")
    return h.hexdigest()[:32]


def _zip(root: str, files: Sequence[tuple[str, os.stat_result]]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as z:
        for rel, st in files:
            info = zipfile.ZipInfo(rel, date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = (st.st_mode & 0xFFFF) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            with open(os.path.join(root, rel), "rb") as f:
                z.writestr(info, f.read(), compresslevel=1)
    return buf.getvalue()


def scan_root(path: str, excludes: Sequence[str]) -> tuple[list[tuple[str, os.stat_result]], str]:
    """The root's files and content hash (re-read only when a file's stat changed)."""
    files = list_files(path, excludes)
    sig = tuple((rel, st.st_size, st.st_mtime_ns, st.st_ino, st.st_mode) for rel, st in files)
    with _lock:
        known = _hashes.get(path)
    if known is not None and known[0] == sig:
        return files, known[1]
    digest = _content_hash(path, files)
    with _lock:
        _hashes[path] = (sig, digest)
    return files, digest


# ------------------------------------------------------------------ the manifest
def build(
    cwd: str | None,
    extra: Sequence[str],
    excludes: Sequence[str],
    max_bytes: int | None,
) -> tuple[Manifest, dict[str, tuple[list[tuple[str, os.stat_result]], str]]]:
    """What a call ships (roots in order: ``cwd`` first, unless ``None``: the user ships a
    ``working_dir`` of their own), checked against ``max_bytes``."""
    manifest = Manifest(cwd=cwd or "")
    scanned: dict[str, tuple[list[tuple[str, os.stat_result]], str]] = {}
    everything: list[tuple[str, int]] = []
    first = [cwd] if cwd else []
    for path in dict.fromkeys([*first, *extra]):
        files, digest = scan_root(path, excludes)
        scanned[path] = (files, digest)
        sizes = tuple((rel, st.st_size) for rel, st in files)
        everything += [(os.path.join(path, rel), s) for rel, s in sizes]
        manifest.roots.append(Root(path, sizes, f"gcs://{PKG_PREFIX}{digest}.zip"))
    total = sum(s for _, s in everything)
    if max_bytes is not None and total > max_bytes:
        big = []
        for r in manifest.roots:
            big += [(os.path.join(r.path, name), s) for name, s in _biggest(r.files)]
        big.sort(key=lambda kv: -kv[1])
        lines = "\n".join(f"  {human_bytes(s):>10}  {p}" for p, s in big[:6])
        raise LaunchError(
            f"backend='ray' ships the working directory and the function's local modules "
            f"to the cluster's nodes: {human_bytes(total)} in {len(everything)} files, over "
            f"the limit of {human_bytes(max_bytes)}. The biggest entries:\n{lines}\n"
            "Exclude what the ranks do not need with a .gitignore line or "
            "ray=gangrun.RayOptions(excludes=['data/', '*.ckpt']), raise the limit with "
            "RayOptions(max_ship_bytes=...), or turn shipping off with RayOptions(ship=False) "
            "(when every node already has the code, e.g. in your image)."
        )
    return manifest, scanned


@dataclass(frozen=True)
class Uploaded:
    """What `upload` did for one call: the packages it sent and those the cluster had."""

    sent: tuple[str, ...] = ()
    present: tuple[str, ...] = ()


def upload(
    manifest: Manifest, scanned: dict[str, tuple[list[tuple[str, os.stat_result]], str]]
) -> Uploaded:
    """Upload every root the cluster does not have yet (Ray's content-addressed GCS store)."""
    exists = _ray_private("runtime_env.packaging", "package_exists")
    put = _ray_private("runtime_env.packaging", "upload_package_to_gcs")
    sent: list[str] = []
    present: list[str] = []
    for root in manifest.roots:
        if exists(root.uri):
            log.debug("%s is on the cluster already (%s)", root.path, root.uri)
            present.append(root.uri)
            continue
        data = _zip(root.path, scanned[root.path][0])
        try:
            put(root.uri, data)
        except Exception as exc:
            raise LaunchError(
                f"Could not upload {root.path} ({human_bytes(len(data))} zipped) to the Ray "
                f"cluster: {exc}. Exclude large files (RayOptions(excludes=[...])) or turn "
                "shipping off with RayOptions(ship=False)."
            ) from exc
        sent.append(root.uri)
        log.info("shipped %s as %s (%s)", root.path, root.uri, human_bytes(len(data)))
    return Uploaded(tuple(sent), tuple(present))


def upload_runtime_env(runtime_env: dict[str, Any]) -> dict[str, Any]:
    """The runtime env with a local ``working_dir``/``py_modules`` the user named uploaded to
    the cluster (with Ray's own functions, as ``ray.init`` does for a job's runtime env; Ray
    refuses local paths in an actor's own runtime env). Needs a connected Ray."""
    wd = runtime_env.get("working_dir")
    mods = runtime_env.get("py_modules") or []
    local = (isinstance(wd, str) and "://" not in wd) or any(
        not isinstance(m, str) or "://" not in m for m in mods
    )
    if not local:
        return runtime_env
    upload_py_modules = _ray_private("runtime_env.py_modules", "upload_py_modules_if_needed")
    upload_working_dir = _ray_private("runtime_env.working_dir", "upload_working_dir_if_needed")
    try:
        worker = _ray_private("worker", "global_worker")
        scratch = worker.node.get_runtime_env_dir_path()
        env = dict(runtime_env)
        env = upload_py_modules(env, include_gitignore=True, scratch_dir=scratch)
        env = upload_working_dir(env, include_gitignore=True, scratch_dir=scratch)
        env.pop("excludes", None)
        return env
    except Exception as exc:
        raise LaunchError(
            f"Could not upload the local working_dir/py_modules of {contract.RAY_RUNTIME_ENV} "
            f"({exc}). Pass them to ray.init(runtime_env=...) yourself before the call, or "
            "give URIs (s3://..., gs://...) instead."
        ) from exc


# ------------------------------------------------------------------ on the node
def remote_paths(
    ship: ShipMap, caller_path: list[str], node_path: list[str]
) -> tuple[str | None, list[str]]:
    """On a node that does not see the caller's files: the rank's working directory (the
    shipped copy of the caller's) and its ``sys.path`` (caller entries mapped into the shipped
    copies, then this node's own). ``None`` for the directory when the cwd was not shipped."""
    local: dict[str, str] = {}
    for caller_root, name in ship.roots:
        for p in node_path:
            if os.path.basename(p.rstrip("/")) == name:
                local[caller_root] = p
                break

    def mapped(p: str) -> str:
        for root in sorted(local, key=len, reverse=True):
            if p == root or p.startswith(root.rstrip("/") + "/"):
                return os.path.normpath(os.path.join(local[root], os.path.relpath(p, root)))
        return p

    cwd = ship.cwd
    paths = [mapped(p) if p else p for p in caller_path]
    paths += [p for p in caller_paths_only(ship, node_path) if p not in paths]
    return (local.get(cwd) if cwd else None), paths


def caller_paths_only(ship: ShipMap, node_path: list[str]) -> list[str]:
    """On the caller's own node: this node's path without the shipped copies."""
    names = {name for _, name in ship.roots}
    return [p for p in node_path if os.path.basename(p.rstrip("/")) not in names]


__all__ = [
    "Manifest",
    "Root",
    "Uploaded",
    "build",
    "upload",
    "upload_runtime_env",
    "remote_paths",
    "sees_caller_files",
]
