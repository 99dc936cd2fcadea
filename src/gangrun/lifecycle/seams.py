"""What a supervisor is built from, injectable (the policy tests pass fakes): the planner,
the gang factory, the output pump factory, the MLflow run's start, and the type of the
call's event queue."""

from __future__ import annotations

from collections.abc import Callable
from typing import IO, TYPE_CHECKING, Any, Union

from ..launch import ExitSink, Gang, GangSpec, RankExit, RayPlacement
from ..options import Options
from .plan import Plan, plan_local
from .state import CancelRequested, PreemptRequested

if TYPE_CHECKING:
    from ..output import OutputPump
    from ..tracking.caller import Tracker
    from ..tracking.plan import TrackingInfo

# What the call's event queue carries: rank exits from the gang, the lifecycle's own events.
QueueItem = Union[RankExit, CancelRequested, PreemptRequested]
GangFactory = Callable[[GangSpec, "OutputPump", ExitSink], Gang]
PumpFactory = Callable[..., "OutputPump"]
Planner = Callable[[Callable[..., Any], Options], tuple[Plan, RayPlacement | None]]
# (the run's params and tags, where its link is printed) -> the MLflow run, or None
TrackingStart = Callable[["TrackingInfo", IO[str]], "Tracker | None"]


def default_planner(fn: Callable[..., Any], opts: Options) -> tuple[Plan, RayPlacement | None]:
    if opts.backend == "ray":
        from .ray_plan import plan_ray

        return plan_ray(fn, opts)
    return plan_local(fn, opts), None


def make_pump(
    stdout: IO[str],
    stderr: IO[str],
    mode: str,
    on_line: Callable[[int, str], None] | None = None,
    name: str = "",
    run_id: str = "",
) -> OutputPump:
    """The call's output pump; ``name`` and ``run_id`` (the call's) go in the prefixes while
    another call streams to the same place."""
    from ..output import OutputPump as Pump

    return Pump(stdout, stderr, mode, on_line, name, run_id)


def start_tracking(info: TrackingInfo, stdout: IO[str]) -> Tracker | None:
    """Create (or resume) the call's MLflow run: an acquisition of the supervisor's, so bad
    tracking input (a missing ``run_id``...) is a ``LaunchError`` before any rank starts;
    ``None`` (after a printed note) when MLflow cannot be used."""
    from ..tracking import Tracker as Tracked

    return Tracked.start(info, stdout)


__all__ = [
    "QueueItem",
    "GangFactory",
    "PumpFactory",
    "Planner",
    "TrackingStart",
    "default_planner",
    "make_pump",
    "start_tracking",
]
