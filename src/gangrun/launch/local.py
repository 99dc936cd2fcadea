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
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from ..platform import signal_tree as _signal_tree
from ..platform import sweep, ticks_now
from . import GangSpec, RankExit

_BOOT = "import sys; sys.path.insert(0, {path!r}); from gangrun.worker import main; main()"
_GANGRUN_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
