"""Fresh interpreters (``start_method="spawn"``): each rank is ``python -c <boot>`` in its
own session and process group, started by the caller itself.

Exits are observed by one blocking ``waitpid`` per rank (the gang's waiter thread), so a
failure reaches the caller within milliseconds, with no polling interval. If the caller dies,
the ranks notice at once: each holds the read end of a pipe whose only write end lives in the
caller; EOF makes the rank kill its whole tree (see ``rank/worker.py``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence

from ..host.system import signal_tree
from ..wire import contract
from . import GangSpec, LostRank, RankIO, RankProcess, RankSpec

GANGRUN_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BOOT = "import sys; sys.path.insert(0, {path!r}); from gangrun.rank.boot import boot; boot()"


def boot_command() -> list[str]:
    """The argv of a fresh rank interpreter."""
    return [sys.executable, "-c", BOOT.format(path=GANGRUN_PARENT)]


def close_fds(fds: Sequence[int]) -> None:
    for fd in fds:
        if fd < 0:
            continue
        try:
            os.close(fd)
        except OSError:
            continue  # already closed by whoever took it over


def close_write_ends(ranks: Sequence[tuple[RankSpec, RankIO]]) -> None:
    """The spawner's duty once the ranks have their copies (or could not be started)."""
    for _, io in ranks:
        close_fds([io.out_w, io.err_w])
        io.out_w = io.err_w = -1


class SpawnedProcess:
    """A rank that is a child of the caller."""

    def __init__(self, popen: subprocess.Popen) -> None:
        self.popen = popen
        self.pid = int(popen.pid)
        self.lost: LostRank | None = None  # a child of ours: never lost by a launcher
        self.node: str | None = None  # this node

    def wait(self) -> int:
        return int(self.popen.wait())

    def signal(self, sig: int) -> None:
        signal_tree([self.pid], sig)


class SpawnSpawner:
    name = "spawn"
    lost_nodes: frozenset[str] = frozenset()  # one node

    def nodes_elsewhere(self) -> dict[int, str]:
        return {}

    def start(self, spec: GangSpec, ranks: Sequence[tuple[RankSpec, RankIO]]) -> list[RankProcess]:
        procs: list[SpawnedProcess] = []
        try:
            for r, io in ranks:
                env = dict(r.env)
                env[contract.LIVENESS_FD] = str(io.live_r)
                popen = subprocess.Popen(
                    boot_command(),
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=io.out_w,
                    stderr=io.err_w,
                    pass_fds=(io.live_r,) if io.live_r >= 0 else (),
                    start_new_session=True,
                    cwd=spec.cwd or None,
                )
                procs.append(SpawnedProcess(popen))
        except BaseException:
            for p in procs:
                p.signal(signal.SIGKILL)
                p.popen.wait(5.0)
            raise
        finally:
            close_write_ends(ranks)
        return list(procs)

    def release(self, grace: float) -> None:
        """Nothing is held beyond the processes themselves."""
