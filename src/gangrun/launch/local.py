"""Rank processes on this node, each a fresh interpreter in its own process group.

Lifecycle (after torch.distributed.elastic's): ``start()`` then ``next_exit(timeout)`` until
every rank is done, ``stop()`` to tear the gang down (SIGTERM, grace, SIGKILL to every
process group and every descendant), ``close()`` to release pipes and threads.

Exits are observed by one blocking ``waitpid`` thread per rank, so a failure reaches the
caller within milliseconds, with no polling interval.

If the caller dies, the ranks notice at once: each holds the read end of a pipe whose only
write end lives in the caller; EOF makes the rank kill its whole tree (see ``worker.py``).
"""

from __future__ import annotations

import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from . import GangSpec, RankExit

_BOOT = "import sys; sys.path.insert(0, {path!r}); from gangrun.worker import main; main()"
_GANGRUN_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _signal_tree(pids: list[int], sig: int) -> None:
    """Send ``sig`` to each rank's process group and to every live descendant."""
    try:
        import psutil
    except ImportError:  # pragma: no cover
        psutil = None  # type: ignore[assignment]
    victims: list[Any] = []
    for pid in pids:
        if psutil is not None:
            try:
                victims.extend(psutil.Process(pid).children(recursive=True))
            except Exception:
                pass
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    for v in victims:
        try:
            v.send_signal(sig)
        except Exception:
            pass


def ticks_now(slack_s: float = 2.0) -> int:
    """Now minus ``slack_s``, in the clock ticks since boot that ``/proc/PID/stat`` uses for
    process start times (0 when unknown: then :func:`sweep` looks at every process)."""
    try:
        with open("/proc/uptime", "rb") as f:
            up = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0
    return max(0, int((up - slack_s) * os.sysconf("SC_CLK_TCK")))


def sweep(run_id: str, since_ticks: int = 0, sig: int = signal.SIGKILL) -> list[int]:
    """Kill any process still carrying this run's id in its environment (a descendant that
    left its rank's process group, e.g. with ``setsid``). Reads ``/proc`` directly and only
    the environment of processes started since ``since_ticks`` (see :func:`ticks_now`): a
    few ms. Returns the pids it signalled."""
    marker = f"\0GANGRUN_RUN_ID={run_id}\0".encode()
    me = os.getpid()
    hit: list[int] = []
    try:
        names = os.listdir("/proc")
    except OSError:  # pragma: no cover - no procfs
        return hit
    for name in names:
        if not name.isdigit() or int(name) == me:
            continue
        try:
            if since_ticks:
                with open(f"/proc/{name}/stat", "rb") as f:
                    if int(f.read().rsplit(b")", 1)[1].split()[19]) < since_ticks:
                        continue
            with open(f"/proc/{name}/environ", "rb") as f:
                data = b"\0" + f.read()
        except (OSError, IndexError, ValueError):
            continue
        if marker in data:
            try:
                os.kill(int(name), sig)
                hit.append(int(name))
            except OSError:
                pass
    if sig == signal.SIGKILL:  # gone when the call returns, not a moment later
        deadline = time.monotonic() + 2.0
        for pid in hit:
            wait_gone(pid, max(0.0, deadline - time.monotonic()))
    return hit


def wait_gone(pid: int, timeout: float) -> None:
    """Wait until ``pid`` (not necessarily our child) has exited, via a pidfd."""
    try:
        pfd = os.pidfd_open(pid)
    except (OSError, AttributeError):
        return
    try:
        p = select.poll()
        p.register(pfd, select.POLLIN)
        p.poll(int(timeout * 1000))
    finally:
        os.close(pfd)


def release_gang(gang: Any) -> None:
    """Close what a gang holds once its ranks are gone: the caller's end of the liveness
    pipe, the exit-waiter threads, the log files (shared by every launcher's ``close()``)."""
    if gang._live_w != -1:
        os.close(gang._live_w)
        gang._live_w = -1
    for t in gang._waiters:
        t.join(1.0)
    for log in gang._logs:
        try:
            log.close()
        except Exception:
            pass
    gang._logs.clear()


class LocalGang:
    """The rank processes of one attempt of one call."""

    def __init__(self, spec: GangSpec, pump: Any) -> None:
        self.spec = spec
        self.pump = pump
        self.procs: dict[int, subprocess.Popen] = {}
        self.pids: dict[int, int] = {}
        self.exits: queue.Queue[RankExit] = queue.Queue()
        self.exitcodes: dict[int, int] = {}
        self._waiters: list[threading.Thread] = []
        self._live_r, self._live_w = os.pipe()
        self.started_at = time.time()
        self._since_ticks = ticks_now()
        self._logs: list[Any] = []

    def start(self) -> None:
        spec = self.spec
        try:
            for r in spec.ranks:
                env = dict(r.env)
                env["GANGRUN_LIVENESS_FD"] = str(self._live_r)
                log_fd = os.open(
                    os.path.join(spec.log_dir, f"rank-{r.rank}.log"),
                    os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                    0o600,
                )
                log = os.fdopen(log_fd, "ab", buffering=0)
                self._logs.append(log)
                proc = subprocess.Popen(
                    [sys.executable, "-c", _BOOT.format(path=_GANGRUN_PARENT)],
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    pass_fds=(self._live_r,),
                    start_new_session=True,
                    cwd=env.get("GANGRUN_CWD") or None,
                )
                self.procs[r.rank] = proc
                self.pids[r.rank] = proc.pid
                assert proc.stdout is not None and proc.stderr is not None
                self.pump.add(r.rank, "out", os.dup(proc.stdout.fileno()), log)
                self.pump.add(r.rank, "err", os.dup(proc.stderr.fileno()), log)
                proc.stdout.close()
                proc.stderr.close()
                t = threading.Thread(
                    target=self._wait,
                    args=(r.rank, proc),
                    name=f"gangrun-wait-{r.rank}",
                    daemon=True,
                )
                t.start()
                self._waiters.append(t)
        finally:
            os.close(self._live_r)
            self._live_r = -1
        self.pump.start()

    def _wait(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        self.exits.put(RankExit(rank, code, time.time()))

    def next_exit(self, timeout: float | None) -> RankExit | None:
        try:
            return self.exits.get(timeout=timeout)
        except queue.Empty:
            return None

    def alive(self) -> list[int]:
        return [r for r, p in self.procs.items() if p.poll() is None]

    def stop(self, grace: float | None = None) -> None:
        """SIGTERM every rank's tree, wait up to ``grace``, then SIGKILL what is left."""
        grace = self.spec.grace_period if grace is None else grace
        pids = list(self.pids.values())
        if self.alive():
            _signal_tree(pids, signal.SIGTERM)
            deadline = time.monotonic() + grace
            for p in self.procs.values():
                left = deadline - time.monotonic()
                try:
                    p.wait(max(0.0, left))
                except subprocess.TimeoutExpired:
                    break
        self.reap_leftovers()

    def reap_leftovers(self) -> None:
        """Kill whatever is left of the ranks' trees (descendants included)."""
        pids = list(self.pids.values())
        _signal_tree(pids, signal.SIGKILL)
        for p in self.procs.values():
            try:
                p.wait(5.0)
            except subprocess.TimeoutExpired:  # pragma: no cover - unkillable (D state)
                pass
        sweep(self.spec.run_id, self._since_ticks)

    def close(self) -> None:
        release_gang(self)
