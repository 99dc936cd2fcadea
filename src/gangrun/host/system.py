"""Platform helpers (Linux): process identity, start ticks, signalling process trees, the
``/proc`` environment sweep and pidfd waits. No gangrun imports: every layer may use this."""

from __future__ import annotations

import functools
import logging
import os
import select
import shutil
import signal
import socket
import stat
import tempfile
import threading
import time
from typing import Any

from ..wire import contract
from ..wire.rundir import RunDir

log = logging.getLogger("gangrun.host.system")


def cpu_count() -> int:
    """CPUs this process may run on (its affinity mask), not the machine's total."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def start_ticks(pid: int | str) -> int | None:
    """When ``pid`` started, in clock ticks since boot (field 22 of ``/proc/PID/stat``)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def process_identity(pid: int) -> str | None:
    """``"pid:start-ticks"``: names one process for its whole life (pids are reused)."""
    ticks = start_ticks(pid)
    return None if ticks is None else f"{pid}:{ticks}"


def ticks_now(slack_s: float = 2.0) -> int:
    """Now minus ``slack_s``, in the clock ticks since boot that ``/proc/PID/stat`` uses for
    process start times (0 when unknown: then `sweep` looks at every process)."""
    try:
        with open("/proc/uptime", "rb") as f:
            up = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0
    return max(0, int((up - slack_s) * os.sysconf("SC_CLK_TCK")))


def signal_tree(pids: list[int], sig: int) -> None:
    """Send ``sig`` to each process group led by ``pids`` and to every live descendant."""
    import psutil

    victims: list[psutil.Process] = []
    for pid in pids:
        try:
            victims.extend(psutil.Process(pid).children(recursive=True))
        except psutil.Error:
            pass  # already gone: nothing below it to find
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass  # the group is gone (or was never ours)
    for v in victims:
        try:
            v.send_signal(sig)
        except psutil.Error:
            pass  # exited meanwhile


def sweep(run_id: str, since_ticks: int = 0, sig: int = signal.SIGKILL) -> list[int]:
    """Kill any process still carrying this run's id in its environment (a descendant that
    left its rank's process group, e.g. with ``setsid``). Reads ``/proc`` directly and only
    the environment of processes started since ``since_ticks`` (see `ticks_now`): a
    few ms. Returns the pids it signalled."""
    marker = f"\0{contract.RUN_ID}={run_id}\0".encode()
    me = os.getpid()
    hit: list[int] = []
    try:
        names = os.listdir("/proc")
    except OSError:  # pragma: no cover - no procfs
        return hit
    for name in names:
        if not name.isdigit() or int(name) == me:
            continue
        if since_ticks:
            ticks = start_ticks(name)
            if ticks is None or ticks < since_ticks:
                continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                data = b"\0" + f.read()
        except OSError:
            continue  # gone, or not ours to read
        if marker in data:
            try:
                os.kill(int(name), sig)
                hit.append(int(name))
            except OSError:
                pass  # exited between the read and the kill
    if hit:
        log.debug("sweep of run %s signalled %s", run_id, hit)
    if sig == signal.SIGKILL:  # gone when the call returns, not a moment later
        deadline = time.monotonic() + 2.0
        for pid in hit:
            wait_gone(pid, max(0.0, deadline - time.monotonic()))
    return hit


def wait_gone(pid: int, timeout: float) -> bool:
    """Wait until ``pid`` (not necessarily our child) has exited, via a pidfd. True if it is
    gone (or was never there)."""
    try:
        pfd = os.pidfd_open(pid)
    except (OSError, AttributeError):
        return True
    try:
        p = select.poll()
        p.register(pfd, select.POLLIN)
        return bool(p.poll(int(timeout * 1000)))
    finally:
        os.close(pfd)


# ----------------------------------------------------------------- subreaper, C stdio, fork
_PR_SET_CHILD_SUBREAPER = 36


@functools.lru_cache(maxsize=1)
def load_libc() -> Any:
    """The C library, opened once per process (a fork inherits the handle): every rank calls
    it at start (subreaper, stdio buffering) and at exit (fflush)."""
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:  # pragma: no cover - no C library to talk to
        return None


def become_subreaper() -> bool:
    """Make this process the child subreaper of its descendants (``PR_SET_CHILD_SUBREAPER``):
    an orphaned descendant, even one in its own session with its own environment, re-parents
    to this process instead of init, so `kill_children` still finds it."""
    libc = load_libc()
    try:
        return libc is not None and libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except AttributeError:  # pragma: no cover - not Linux
        return False


def child_pids(pid: int | None = None) -> list[int]:
    """Direct children of ``pid`` (default: this process), from ``/proc/PID/task/*/children``."""
    pid = os.getpid() if pid is None else pid
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                found += [int(x) for x in f.read().split()]
        except (OSError, ValueError):
            continue  # the thread ended meanwhile
    return found


def kill_children(keep: frozenset[int] | set[int] = frozenset()) -> list[int]:
    """SIGKILL every descendant of this process except the subtrees rooted at ``keep``
    (whatever session or environment they have). Returns the pids signalled."""
    import psutil

    hit: list[int] = []
    for pid in child_pids():
        if pid in keep:
            continue
        try:
            victims = [psutil.Process(pid)]
            victims += victims[0].children(recursive=True)
        except psutil.Error:
            continue  # already gone
        for v in victims:
            try:
                v.kill()
                hit.append(v.pid)
            except psutil.Error:
                pass  # exited meanwhile
    if hit:
        log.debug("killed leftover descendants %s", hit)
    return hit


def flush_c_stdio() -> None:
    """``fflush(NULL)``: write out what C code (``printf`` in NCCL, C++ extensions, CUDA
    libraries) left in C stdio buffers; ``os._exit`` skips it."""
    libc = load_libc()
    try:
        if libc is not None:
            libc.fflush(None)
    except (AttributeError, OSError):  # pragma: no cover - no C stdio to flush
        return


def set_c_stdio_buffering(unbuffered: bool) -> None:
    """Buffer C ``stdout``/``stderr`` as a fresh interpreter would over a pipe: unbuffered
    with ``PYTHONUNBUFFERED`` (what Python's start-up does), else line buffered (not the
    full buffering a forked child inherits, whose bytes ``os._exit`` would drop)."""
    import ctypes

    libc = load_libc()
    if libc is None:  # pragma: no cover
        return
    mode = 2 if unbuffered else 1  # _IONBF, _IOLBF (glibc)
    for name in ("stdout", "stderr"):
        try:
            stream = ctypes.c_void_p.in_dll(libc, name)
            libc.setvbuf(stream, None, mode if name == "stdout" else 2, 0)
        except (ValueError, AttributeError):  # pragma: no cover - not glibc/musl
            continue


class _AtFork:
    """Objects to tell, in a child forked from this process, that they are not theirs:
    liveness pipes and fork-server channels must not keep a dead caller's ranks alive."""

    def __init__(self) -> None:
        import weakref

        self.objects: weakref.WeakSet[object] = weakref.WeakSet()
        self.registered = False


_at_fork = _AtFork()


def forget_in_forked_child(obj: object) -> None:
    """Call ``obj.after_fork_in_child()`` in any child this process forks from now on."""
    if not _at_fork.registered:
        _at_fork.registered = True
        os.register_at_fork(after_in_child=_run_after_fork)
    _at_fork.objects.add(obj)


def _run_after_fork() -> None:
    for obj in list(_at_fork.objects):
        try:
            obj.after_fork_in_child()  # type: ignore[attr-defined]
        except Exception:  # never break the user's fork
            log.debug("after-fork cleanup of %r failed", obj, exc_info=True)
    _at_fork.objects.clear()


_ports_lock = threading.Lock()
_recent_ports: list[int] = []  # handed out lately: concurrent calls never get the same one


def free_port(host: str = "127.0.0.1") -> int:
    """A free TCP port on ``host`` (not one handed out lately in this process)."""
    port = 0
    for _ in range(64):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        with _ports_lock:
            if port not in _recent_ports:
                _recent_ports.append(port)
                del _recent_ports[:-256]
                return port
    return port


def own_dirs(tmp: str, prefix: str) -> list[str]:
    """The directories in ``tmp`` whose name starts with ``prefix`` and that belong to this
    user: real directories, never a symlink (a name planted by another user is not ours)."""
    try:
        names = [n for n in os.listdir(tmp) if n.startswith(prefix)]
    except OSError:
        return []
    uid, out = os.getuid(), []
    for name in sorted(names):
        path = os.path.join(tmp, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue  # gone meanwhile
        if st.st_uid == uid and stat.S_ISDIR(st.st_mode):  # lstat: a symlink is not a dir
            out.append(path)
    return out


def remove_unrecorded(run_id: str, tmp: str | None = None) -> list[str]:
    """Remove this user's run directories of call ``run_id`` (``gangrun-<run_id>-*``): the
    call was interrupted (Ctrl-C between two bytecodes) after `create` made its directory
    and before the call recorded it. Run ids are random: no other call's directory matches."""
    removed = own_dirs(tmp or tempfile.gettempdir(), f"gangrun-{run_id}-")
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


_reaped_stale = False


def reap_stale(tmp: str | None = None, *, force: bool = False) -> list[str]:
    """Remove run directories (payloads, logs) left in the temp dir by callers of this user
    that died without cleaning up (SIGKILL, a kernel restart). Once per process; cheap.

    Only directories whose caller provably ran on this host, in this PID namespace, and is
    gone are removed: a shared temp dir (two containers, hosts on a shared filesystem) holds
    other machines' live calls, whose pids mean nothing here."""
    global _reaped_stale
    if _reaped_stale and not force:
        return []
    _reaped_stale = True
    removed: list[str] = []
    for path in own_dirs(tmp or tempfile.gettempdir(), "gangrun-"):
        try:
            ctx = RunDir(path).read_context()
        except (OSError, ValueError):
            continue  # not a run directory, or still being written: not ours to judge
        if not ctx.caller or not ctx.same_machine():
            continue
        pid = int(ctx.caller.split(":", 1)[0])
        if process_identity(pid) != ctx.caller:  # that caller is gone
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed:
        log.debug("removed stale run directories %s", removed)
    return removed
