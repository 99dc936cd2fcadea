"""What this machine says of a process's memory (Linux): the resident memory of a process tree,
the memory cgroup a process is in (v1 or v2) with its limit, peak and ``oom_kill`` counter,
and the kernel log's record of an out-of-memory kill. Readers return ``None`` where the host
does not offer a figure; the parsers are pure (tests feed them the files' text)."""

from __future__ import annotations

import errno
import os
import re
import time
from collections import deque
from dataclasses import dataclass

from .system import child_pids

_NO_LIMIT = 1 << 60  # v1 writes "no limit" as a huge number (9223372036854771712)
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
KMSG_MAX_RECORDS = 50_000  # read at most this many kernel log records


# ---------------------------------------------------------------- resident memory
def process_rss(pid: int) -> int | None:
    """Bytes resident of ``pid`` (``/proc/PID/statm``), None when it is gone."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None


def tree_rss(pid: int, max_procs: int = 512) -> int | None:
    """Bytes resident of ``pid`` and its descendants (pages shared between them are counted
    once per process, as ``ps`` does); None when ``pid`` is gone."""
    own = process_rss(pid)
    if own is None:
        return None
    total, todo, seen = own, child_pids(pid), {pid}
    while todo and len(seen) < max_procs:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        total += process_rss(p) or 0
        todo += child_pids(p)
    return total


def machine_ram() -> int | None:
    """Bytes of RAM of the machine (``MemTotal``)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


# ---------------------------------------------------------------- memory cgroups
@dataclass(frozen=True)
class Cgroup:
    """A memory cgroup: its name (as ``/proc/PID/cgroup`` writes it), version, directory."""

    name: str
    version: int
    path: str


@dataclass(frozen=True)
class CgroupMemory:
    """A memory cgroup's figures now (``None``: not offered by this host)."""

    limit: int | None  # the lowest limit of the cgroup and its ancestors
    usage: int | None
    peak: int | None
    oom_kills: int | None


def parse_proc_cgroup(text: str) -> dict[int, str]:
    """``/proc/PID/cgroup`` -> {1: the v1 memory cgroup, 2: the v2 cgroup} (those present)."""
    out: dict[int, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if hid == "0" and controllers == "":
            out[2] = path
        elif "memory" in controllers.split(","):
            out[1] = path
    return out


def parse_mountinfo(text: str) -> dict[int, tuple[str, str]]:
    """``/proc/self/mountinfo`` -> {1: (root, mount point) of the v1 memory hierarchy, 2: of
    the v2 one}."""
    out: dict[int, tuple[str, str]] = {}
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        f, r = left.split(), right.split()
        if len(f) < 5 or len(r) < 3:
            continue
        if r[0] == "cgroup" and "memory" in r[2].split(","):
            out.setdefault(1, (f[3], f[4]))
        elif r[0] == "cgroup2":
            out.setdefault(2, (f[3], f[4]))
    return out


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def mounts() -> dict[int, tuple[str, str]]:
    """This machine's memory cgroup hierarchies (`parse_mountinfo`)."""
    return parse_mountinfo(_read("/proc/self/mountinfo") or "")


def cgroup_path(version: int, name: str, mounted: dict[int, tuple[str, str]] | None = None) -> str:
    """The directory of cgroup ``name`` of hierarchy ``version`` (may not exist)."""
    if mounted is None:
        mounted = mounts()
    root, point = mounted.get(version, ("/", "/sys/fs/cgroup" if version == 2 else ""))
    if not point:
        point = "/sys/fs/cgroup/memory"
    rel = name[len(root) :] if root != "/" and name.startswith(root) else name
    return os.path.join(point, rel.lstrip("/"))


def memory_cgroup(pid: int | str = "self") -> Cgroup | None:
    """The memory cgroup ``pid`` is in: v1's memory hierarchy where mounted, else the v2
    cgroup when it has the memory controller; None when neither can be read."""
    names = parse_proc_cgroup(_read(f"/proc/{pid}/cgroup") or "")
    mounted = mounts()
    for version in (1, 2):
        if version in names and version in mounted:
            path = cgroup_path(version, names[version], mounted)
            marker = "memory.limit_in_bytes" if version == 1 else "memory.max"
            if os.path.exists(os.path.join(path, marker)):
                return Cgroup(names[version], version, path)
    return None


def parse_memory_events(text: str) -> int | None:
    """v2 ``memory.events`` -> its ``oom_kill`` counter."""
    return _field(text, "oom_kill")


def parse_oom_control(text: str) -> int | None:
    """v1 ``memory.oom_control`` -> its ``oom_kill`` counter (kernels from 4.13)."""
    return _field(text, "oom_kill")


def _field(text: str, key: str) -> int | None:
    for line in text.splitlines():
        k, _, v = line.partition(" ")
        if k == key:
            try:
                return int(v)
            except ValueError:
                return None
    return None


def _number(text: str | None) -> int | None:
    if text is None:
        return None
    text = text.strip()
    if text == "max":
        return None
    try:
        n = int(text)
    except ValueError:
        return None
    return None if n >= _NO_LIMIT else n


def _limit(cg: Cgroup) -> int | None:
    """The lowest limit of ``cg`` and its ancestors up to the hierarchy's mount point."""
    name = "memory.limit_in_bytes" if cg.version == 1 else "memory.max"
    found: list[int] = []
    path = cg.path
    for _ in range(64):
        n = _number(_read(os.path.join(path, name)))
        if n is not None:
            found.append(n)
        parent = os.path.dirname(path)
        if parent == path or not os.path.exists(os.path.join(parent, name)):
            break
        path = parent
    return min(found) if found else None


def cgroup_memory(cg: Cgroup) -> CgroupMemory:
    """``cg``'s limit, usage, peak and ``oom_kill`` counter now."""
    if cg.version == 1:
        usage, peak = "memory.usage_in_bytes", "memory.max_usage_in_bytes"
        kills = parse_oom_control(_read(os.path.join(cg.path, "memory.oom_control")) or "")
    else:
        usage, peak = "memory.current", "memory.peak"
        kills = parse_memory_events(_read(os.path.join(cg.path, "memory.events")) or "")
    return CgroupMemory(
        limit=_limit(cg),
        usage=_number(_read(os.path.join(cg.path, usage))),
        peak=_number(_read(os.path.join(cg.path, peak))),
        oom_kills=kills,
    )


# ---------------------------------------------------------------- the kernel log
@dataclass(frozen=True)
class KernelKill:
    """The kernel log's record of an out-of-memory kill of ``pid``."""

    pid: int
    rss: int | None  # bytes resident when killed (anon + file + shmem)
    memcg: str | None  # the memory cgroup the task was in (task_memcg=)
    limited_by: str | None  # the cgroup whose limit was hit (oom_memcg=), "" for the machine


_KILLED = re.compile(r"Killed process (\d+) \([^)]*\)(.*)")
_RSS_PART = re.compile(r"(anon|file|shmem)-rss:(\d+)kB")
_OOM_KILL = re.compile(r"oom-kill:(\S*)")


def parse_kernel_log(lines: list[str], pid: int, memcg: str | None = None) -> KernelKill | None:
    """The kill of ``pid`` among kernel log lines (``dmesg`` or ``/dev/kmsg`` text): "Out of
    memory: Killed process PID (...) ... anon-rss:...kB, file-rss:...kB" and the
    "oom-kill:...,oom_memcg=...,task_memcg=...,pid=PID" line before it. The last such kill;
    failing that (the kernel names pids of its own namespace, not a container's), the last
    kill of a task in memory cgroup ``memcg``."""
    found: KernelKill | None = None
    in_memcg: KernelKill | None = None
    context: dict[str, dict[str, str]] = {}
    for line in lines:
        m = _OOM_KILL.search(line)
        if m:
            tokens = m.group(1).split(",")
            kv = dict(p.split("=", 1) for p in tokens if "=" in p)
            if "global_oom" in tokens or kv.get("constraint") == "CONSTRAINT_NONE":
                kv.setdefault("oom_memcg", "/")  # the machine ran out
            if "pid" in kv:
                context[kv["pid"]] = kv
            continue
        k = _KILLED.search(line)
        if k is None:
            continue
        parts = _RSS_PART.findall(k.group(2))
        rss = sum(int(v) for _, v in parts) * 1024 if parts else None
        kv = context.get(k.group(1), {})
        oom_memcg = kv.get("oom_memcg")
        if oom_memcg is None and line.lstrip("[]0123456789. ").startswith("Out of memory"):
            oom_memcg = "/"  # an older kernel's words for the machine running out
        kill = KernelKill(
            int(k.group(1)),
            rss,
            kv.get("task_memcg"),
            None if oom_memcg is None else ("" if oom_memcg == "/" else oom_memcg),
        )
        if kill.pid == pid:
            found = kill
        elif memcg is not None and kill.memcg == memcg:
            in_memcg = kill
    return found or in_memcg


def _uptime() -> float | None:
    try:
        with open("/proc/uptime") as f:
            return float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def read_kernel_log(
    max_records: int = KMSG_MAX_RECORDS, since: float | None = None
) -> list[str] | None:
    """The kernel log's newest messages (``/dev/kmsg``, read without blocking), those logged at
    ``since`` (wall clock) or later when given; None when it cannot be read here (no
    permission: ``dmesg_restrict``, a container)."""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    after = None  # `since` in the log's clock: microseconds since boot
    up = _uptime() if since is not None else None
    if since is not None and up is not None:
        after = (since - (time.time() - up)) * 1e6
    out: deque[str] = deque(maxlen=max_records)  # the newest
    try:
        for _ in range(1_000_000):  # the ring holds far fewer: a bound, never reached
            try:
                rec = os.read(fd, 8192)
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # overwritten while read: go on with the next
                    continue
                if exc.errno == errno.EAGAIN:
                    break
                return list(out) or None
            if not rec:
                break
            prefix, _, msg = rec.decode("utf-8", "replace").partition(";")
            if after is not None:
                fields = prefix.split(",")
                if len(fields) > 2 and fields[2].isdigit() and int(fields[2]) < after:
                    continue
            out.append(msg.split("\n", 1)[0])
    finally:
        os.close(fd)
    return list(out)


def kernel_kill(
    pid: int, memcg: str | None = None, since: float | None = None
) -> tuple[bool, KernelKill | None]:
    """(whether the kernel log could be read, its record of the kill of ``pid`` at ``since``
    (wall clock) or later, see `parse_kernel_log`)."""
    lines = read_kernel_log(since=since)
    if lines is None:
        return False, None
    return True, parse_kernel_log(lines, pid, memcg)


__all__ = [
    "Cgroup",
    "CgroupMemory",
    "KernelKill",
    "cgroup_memory",
    "cgroup_path",
    "kernel_kill",
    "machine_ram",
    "memory_cgroup",
    "mounts",
    "parse_kernel_log",
    "parse_memory_events",
    "parse_mountinfo",
    "parse_oom_control",
    "parse_proc_cgroup",
    "process_rss",
    "read_kernel_log",
    "tree_rss",
]
