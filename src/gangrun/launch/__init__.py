"""Launchers: how rank processes are started, watched and stopped.

One concrete gang (`gangrun.launch.gang.ProcessGang`) over one `Spawner`
protocol, implemented three times:

- `spawn`: fresh interpreters (``start_method="spawn"``);
- `forkserver`: ranks forked from a warm helper that imported torch but never touched
  CUDA (``start_method="forkserver"``, the default where usable);
- `ray`: one small actor per rank on a Ray cluster (``spec.placement`` set).

The seam to the call's lifecycle is `open_gang`: it returns a `Gang` for a
`GangSpec`; the gang puts one `RankExit` per rank into the ``events`` queue the
lifecycle owns (which also carries the lifecycle's own events: cancel, deadline, ...).
`shutdown` closes the launch machinery (fork servers) at the caller's exit.
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ..options import ForkServerOptions, RayOptions
    from ..output import OutputPump


@dataclass
class RankSpec:
    rank: int
    env: dict[str, str]


@dataclass(frozen=True)
class RayPlacement:
    """Where and how a Ray gang is placed (decided by the plan, used by the Ray launcher)."""

    bundle: dict[str, float]  # resources of one rank's bundle, e.g. {"GPU": 1.0}
    strategy: str  # placement group strategy: PACK, SPREAD, STRICT_PACK, STRICT_SPREAD
    runtime_env: dict = field(default_factory=dict)
    placement_timeout: float = 300.0
    gpu_type: str | None = None  # checked against each node's accelerator
    user_omp: bool = False  # OMP_NUM_THREADS set by the user: keep it on every node
    shipping: RayOptions | None = None  # what ships to the nodes (None: nothing)


@dataclass
class GangSpec:
    run_id: str
    run_dir: str
    ranks: list[RankSpec]
    log_dir: str
    output: str = "all"
    grace_period: float = 5.0
    cwd: str = ""  # the ranks' working directory (the caller's)
    start_method: str = "auto"  # auto | spawn | forkserver (local backend)
    forkserver: ForkServerOptions | None = None  # the fork server's settings (None: built-in)
    placement: RayPlacement | None = None  # set: the Ray backend


@dataclass(frozen=True)
class LostRank:
    """The launch machinery lost a rank: it cannot say how the rank itself ended (its fork
    server died, its Ray actor or node went away, waiting for it failed). What the caller's
    error says of it; ``lifecycle.rootcause.rank_failure`` turns it into the rank's failure."""

    why: str  # in words: "the fork server (pid 12) died (killed by SIGKILL)"
    exc_type: str | None = None  # e.g. "ray.ActorDiedError" (the restart rules read it)
    detail: str = ""  # the longer story (the failure's traceback text)
    launcher: bool = True  # gangrun's own machinery died: no rank is to blame
    hint: str = ""  # what to do about it, for the caller's error


@dataclass(frozen=True)
class RankExit:
    rank: int
    exitcode: int
    time: float  # time.time() when the exit was observed
    lost: LostRank | None = None  # set when the launch machinery itself lost the rank
    node: str | None = None  # a rank on another node (Ray): that node, as errors name it


class RankIO:
    """The pipes one rank starts with. A `Spawner` takes ownership of ``out_w`` and
    ``err_w`` (closes them once handed over, also on failure); ``live_r`` (the read end of
    the caller's liveness pipe, -1 for none) stays the gang's."""

    __slots__ = ("out_w", "err_w", "live_r")

    def __init__(self, out_w: int, err_w: int, live_r: int) -> None:
        self.out_w = out_w
        self.err_w = err_w
        self.live_r = live_r


class RankProcess(Protocol):
    """One started rank, whatever started it (cf. CPython's ``multiprocessing`` Popen)."""

    pid: int

    @property
    def lost(self) -> LostRank | None:
        """Read after `wait`: set when the launcher itself lost the rank (a dead fork server,
        a lost Ray actor), see `RankExit.lost`."""

    @property
    def node(self) -> str | None:
        """The rank's node when it is another than the caller's (Ray), as errors name it,
        see `RankExit.node`."""

    def wait(self) -> int:
        """Block until the rank ended; its exit code (``-N``: killed by signal ``N``). Called
        once, from the gang's exit-waiter thread for this rank."""

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the rank's whole tree (its process group and descendants)."""


class Spawner(Protocol):
    """Starts the rank processes of one gang (fresh interpreters, fork server, Ray)."""

    name: str

    @property
    def lost_nodes(self) -> Set[str]:
        """The nodes of ranks whose launcher lost them (Ray: a lost actor's node)."""

    def nodes_elsewhere(self) -> dict[int, str]:
        """The ranks on another node than the caller's, and their node as errors name it
        (``{}`` on one node)."""

    def start(self, spec: GangSpec, ranks: Sequence[tuple[RankSpec, RankIO]]) -> list[RankProcess]:
        """One process per entry, in order; all or nothing (on failure what started is killed
        and the error raised). Blocks until every rank runs."""

    def release(self, grace: float) -> None:
        """The gang ended (its ranks are gone or being stopped with ``grace``): give back
        what the spawner holds for it (a fork-server lease, Ray actors and bundles)."""


class ExitSink(Protocol):
    """Where a gang reports rank exits: the lifecycle's event queue (``queue.Queue``), which
    also carries the lifecycle's own events."""

    def put(self, item: RankExit) -> None: ...


class Gang(Protocol):
    """The rank processes of one attempt of one call."""

    pids: dict[int, int]  # rank -> pid of the rank's process

    @property
    def spec(self) -> GangSpec: ...
    @property
    def spawner(self) -> Spawner: ...  # what started the ranks (the narration names it)

    def start(self) -> None: ...

    def alive(self) -> list[int]: ...

    def nodes_elsewhere(self) -> dict[int, str]:
        """The ranks on another node than the caller's, and their node as errors name it
        (Ray; ``{}`` on one node)."""

    def signal_rank(self, rank: int, sig: int) -> None:
        """Send ``sig`` to one rank's tree, wherever it runs."""

    def stop(self, grace: float | None = None) -> None:
        """SIGTERM every rank's tree, wait up to ``grace``, SIGKILL what is left, sweep."""

    def reap_leftovers(self) -> None:
        """Kill whatever is left of the ranks' trees (descendants included)."""

    def close(self) -> None:
        """Release pipes, threads and log files (after the ranks are gone)."""


def open_gang(spec: GangSpec, pump: OutputPump, events: ExitSink) -> Gang:
    """The gang for ``spec``: Ray actors when ``spec.placement`` is set, else fork server or
    fresh interpreters by ``spec.start_method``. Exits go into ``events``."""
    from .gang import ProcessGang, choose_spawner

    return ProcessGang(spec, pump, events, choose_spawner(spec))


def shutdown() -> None:
    """Close the launch machinery of this process (its fork servers): the lifecycle's exit
    hook calls it after stopping the calls still active."""
    from .forkserver.client import registry

    registry.close_all()
