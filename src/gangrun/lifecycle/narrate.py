"""``GANGRUN_LOG_LEVEL=DEBUG``: a call narrates its lifecycle on the ``gangrun`` logger.

The plan (function, world size, backend, GPUs), the acquisitions (run and log directory,
the GPUs reserved), each attempt's launch (the spawner, chosen in `gangrun.launch.gang`
with its reason, the rendezvous port, every rank's pid), each rank's exit with its code and
time, the teardown, restarts and the end. Nothing is formatted unless DEBUG is on.
"""

from __future__ import annotations

import logging
import time

from ..wire.exitcodes import signal_name
from .observers import CallView, Observer
from .state import State

log = logging.getLogger("gangrun.lifecycle")


class NarratorObserver(Observer):
    def __init__(self, run: CallView) -> None:
        self.run = run
        self.t0 = time.monotonic()
        self.attempt_t0 = self.t0

    def _on(self) -> bool:
        return log.isEnabledFor(logging.DEBUG)

    def on_plan(self, run: CallView) -> None:
        if not self._on():
            return
        call, opts = run.call, run.call.options
        where = f"GPUs {opts.gpus}" if opts.gpus is not None else f"processes={opts.processes}"
        log.debug(
            "call %s: plan: %s on %d rank(s), backend %s, %s, start_method %s, timeout %s",
            call.run_id,
            call.fn_name,
            call.world_size,
            opts.backend,
            where,
            opts.start_method,
            opts.timeout,
        )

    def on_transition(self, state: State, run: CallView) -> None:
        if not self._on():
            return
        rid, outcome, max_restarts = run.call.run_id, run.outcome, run.call.max_restarts
        if state is State.LAUNCHING:
            self.attempt_t0 = time.monotonic()
            gpus = [f"{d.index} ({d.name})" for d in run.devices]
            log.debug(
                "call %s: attempt %d/%d launching: run dir %s, logs %s, GPUs %s",
                rid,
                run.attempt + 1,
                max_restarts + 1,
                run.run_dir,
                run.log_dir,
                ", ".join(gpus) or "none",
            )
        elif state is State.RUNNING:
            gang = run.gang
            ranks = gang.spec.ranks if gang is not None else []
            port = ranks[0].env.get("MASTER_PORT") if ranks else "?"
            pids = dict(gang.pids) if gang is not None else {}
            spawner = type(gang.spawner).__name__ if gang is not None else "?"
            log.debug(
                "call %s: %d rank(s) started in %.2fs by %s, rendezvous port %s",
                rid,
                len(pids),
                time.monotonic() - self.attempt_t0,
                spawner,
                port,
            )
            for r, pid in sorted(pids.items()):
                log.debug("call %s: rank %d started: pid %d", rid, r, pid)
        elif state is State.STOPPING:
            gang = run.gang
            live = gang.alive() if gang is not None else []
            log.debug(
                "call %s: teardown: %s (grace %gs)",
                rid,
                f"stopping live rank(s) {sorted(live)}" if live else "every rank has exited",
                run.call.options.grace_period,
            )
        elif state is State.RESTARTING:
            err = outcome.attempts[-1].error if outcome.attempts else None
            log.debug(
                "call %s: restart %d/%d after %s",
                rid,
                run.attempt + 1,
                max_restarts,
                type(err).__name__ if err is not None else "a failure",
            )
        elif state.terminal:
            err = outcome.error
            tracked = None if run.tracker is None else run.tracker.run_id
            log.debug(
                "call %s: ended %s after %.2fs%s%s",
                rid,
                state.value,
                time.monotonic() - self.t0,
                f" (MLflow run {tracked} {outcome.mlflow_status})" if tracked else "",
                f": {type(err).__name__}: {str(err).splitlines()[0]}"
                if err is not None and str(err)
                else "",
            )

    def on_rank_exit(self, rank: int, exitcode: int, stopped: bool) -> None:
        if not self._on():
            return
        sig = signal_name(exitcode)
        log.debug(
            "call %s: rank %d exited with %s after %.2fs%s",
            self.run.call.run_id,
            rank,
            sig or f"code {exitcode}",
            time.monotonic() - self.attempt_t0,
            " (stopped by the teardown)" if stopped else "",
        )


def attach(run: CallView) -> list[Observer]:
    return [NarratorObserver(run)]


__all__ = ["NarratorObserver", "attach"]
