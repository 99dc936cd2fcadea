"""One call's fixed facts, in one place: `CallRecord`, built once when its supervisor is made.

What the call is (the function, its arguments, its `Options`), who it is (its run id, the
function's name and, once planned, its world size and placement) and where its output goes
(the caller's stdout/stderr, or the cell's writers in a notebook). Frozen: the supervisor,
its observers, the notebook panel and the handle all read this one record; none keeps a copy
of its fields, and nothing changes it afterwards. What changes while the call runs (the
attempt, the run directory, the MLflow run) is the supervisor's, read through its public
face (`gangrun.lifecycle.observers.CallView`).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any, Literal

from ..launch import RayPlacement
from ..options import Options
from .plan import Plan

if TYPE_CHECKING:
    from ..tracking.plan import TrackingInfo


# What made the call, told by it when the supervisor is made (`gangrun ps` shows it): the
# notebook's wiring says "kernel", ``gangrun run`` says so, anything else is a script.
CallerKind = Literal["kernel", "gangrun run", "script"]


def new_run_id() -> str:
    """A call's id: 12 hex digits (the run directory, the rank environment, ``gangrun ps``)."""
    return uuid.uuid4().hex[:12]


@dataclass(frozen=True)
class CallRecord:
    """One call: identity, options and I/O, fixed before anything is acquired."""

    run_id: str
    fn_name: str
    plan: Plan  # the world size and devices (side-effect free: nothing acquired)
    options: Options
    stdout: IO[str] = field(repr=False)
    stderr: IO[str] = field(repr=False)
    fn: Callable[..., Any] = field(repr=False, compare=False)
    args: tuple = field(default=(), repr=False, compare=False)
    kwargs: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    placement: RayPlacement | None = field(default=None, repr=False)  # backend="ray"
    caller: CallerKind = "script"

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    @property
    def max_restarts(self) -> int:
        return self.options.max_restarts


def tracking_info(call: CallRecord, gpu_name: str | None) -> TrackingInfo:
    """What the call's MLflow run records about it (params and tags); ``gpu_name``: the
    reserved GPUs' (the plan's candidates are only a guess)."""
    import functools
    import socket

    from ..tracking.plan import TrackingInfo, call_arguments
    from ..version import __version__
    from .checkpoints import check_resume

    opts = call.options
    return TrackingInfo(
        function=call.fn_name,
        world_size=call.world_size,
        run_id=call.run_id,
        options=opts,  # experiment_name, run_name, run_id, tags, log_system_metrics
        processes=opts.processes,
        gpus=opts.gpus if opts.processes is None else None,
        gpu_type=gpu_name or call.plan.gpu_name or opts.gpu_type,
        timeout=opts.timeout,
        version=__version__,
        host=socket.gethostname(),
        args=call_arguments(call.fn, call.args, dict(call.kwargs)),  # by parameter name
        # the file the call runs, when the callable names it (gangrun run: the script)
        source=getattr(call.fn, "source_file", None),
        backend="ray" if call.plan.backend == "ray" else None,
        # a resume its checkpoints would refuse is refused before the run is touched
        check_resume=functools.partial(check_resume, opts),
    )


__all__ = ["CallRecord", "CallerKind", "new_run_id", "tracking_info"]
