"""The keeper of a call's memory snapshots: a small process per call and node that owns the
call's snapshot directory in ``/dev/shm`` and removes it when the call ends, however it ends.

The caller starts it (`start`) before the first rank, as a sibling of the ranks (not a
child of any rank: it outlives them and a restart of the whole gang). It creates the
directory (0700), holds an exclusive ``flock`` on its ``.keeper`` file for its whole life (a
rank tells a live keeper from a dead one by it: `alive`), says ``ready``, then waits for EOF
on its stdin, the read end of a pipe only the caller holds: the caller's `Keeper.stop` at
the call's end, or the caller's death (SIGKILL included) closes it. Then it renames the
directory away (a rank can no longer create a file in it) and removes it. The ranks write
their slots (`gangrun.wire.snapshot`) in the directory; the keeper never reads them.

A directory whose keeper is gone (killed with the caller) is removed by the next call's
`sweep`. This file runs as a script (``python -I keeper.py DIR``): it imports the standard
library only, so the keeper starts in a few tens of milliseconds.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import time

SHM = "/dev/shm"
PREFIX = "gangrun-mem-"  # = gangrun.wire.snapshot.DIR_PREFIX (this file runs stdlib-only)
LOCK = ".keeper"  # = gangrun.wire.snapshot.KEEPER_LOCK
_READY_S = 30.0
_STOP_S = 10.0


def _remove(path: str) -> None:
    """Rename ``path`` away, then remove it (retried: a rank may create a file meanwhile)."""
    gone = f"{path}.gone-{os.getpid()}"
    try:
        os.rename(path, gone)
    except FileNotFoundError:
        return
    except OSError:
        gone = path
    deadline = time.monotonic() + 10.0
    while os.path.lexists(gone) and time.monotonic() < deadline:
        shutil.rmtree(gone, ignore_errors=True)
        if os.path.lexists(gone):
            time.sleep(0.05)


def _serve(path: str) -> int:
    """The keeper process: create ``path``, hold its lock, wait for EOF on stdin, remove it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the caller's to handle
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # the finally below removes it
    tmp = f"{path}.new-{os.getpid()}"
    os.mkdir(tmp, 0o700)
    fd = os.open(os.path.join(tmp, LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, str(os.getpid()).encode())  # who holds it (diagnostics, tests)
    os.rename(tmp, path)
    try:
        sys.stdout.write("ready\n")
        sys.stdout.flush()
        with contextlib.suppress(OSError, ValueError):
            while os.read(0, 4096):
                pass
    finally:
        _remove(path)
    return 0


def alive(path: str) -> bool:
    """Whether the keeper of snapshot directory ``path`` lives (holds its lock)."""
    try:
        fd = os.open(os.path.join(path, LOCK), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
    return False


def sweep(shm: str = SHM) -> list[str]:
    """Remove this user's snapshot directories whose keeper is gone; the removed paths."""
    removed: list[str] = []
    try:
        names = os.listdir(shm)
    except OSError:
        return removed
    for name in names:
        path = os.path.join(shm, name)
        if not name.startswith(PREFIX):
            continue
        pid = name.partition(".")[2]  # a keeper's .new-PID / .gone-PID directory
        if pid and _pid_lives(pid.rsplit("-", 1)[-1]):
            continue
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
        except OSError:
            continue
        if pid or not alive(path):
            _remove(path)
            removed.append(path)
    return removed


def _pid_lives(text: str) -> bool:
    try:
        os.kill(int(text), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


class Keeper:
    """The caller's handle on a running keeper."""

    def __init__(self, path: str, proc: subprocess.Popen[bytes]) -> None:
        self.path, self.proc = path, proc

    def running(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        """End the keeper (it removes the directory); idempotent, bounded."""
        with contextlib.suppress(OSError, ValueError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(_STOP_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(_STOP_S)
        with contextlib.suppress(OSError, ValueError):
            if self.proc.stdout is not None:
                self.proc.stdout.close()
        _remove(self.path)  # a keeper killed before it could


def start(call_id: str, shm: str = SHM) -> Keeper:
    """Start the keeper of call ``call_id``'s snapshot directory; raises ``OSError`` when it
    cannot (no ``/dev/shm``, the keeper did not say ready within its bound)."""
    if not os.path.isdir(shm):
        raise OSError(f"{shm} does not exist on this machine")
    path = os.path.join(shm, PREFIX + call_id)
    proc = subprocess.Popen(
        [sys.executable, "-I", os.path.abspath(__file__), path],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        close_fds=True,
        start_new_session=True,  # a Ctrl-C in the caller's terminal is the caller's
    )
    keeper = Keeper(path, proc)
    assert proc.stdout is not None
    import selectors

    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        ready = sel.select(_READY_S) and proc.stdout.readline() == b"ready\n"
    if not ready:
        keeper.stop()
        raise OSError(f"the snapshot keeper did not start within {_READY_S:g} s")
    return keeper


if __name__ == "__main__":
    sys.exit(_serve(sys.argv[1]))
