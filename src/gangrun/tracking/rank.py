"""Rank side of tracking: end the MLflow runs a rank's own code opened, before it exits.

A rank leaves with ``os._exit`` (see `gangrun.worker`), which skips MLflow's exit hook:
good for the call's own run (that hook would end it from a rank, while other ranks still log),
bad for every run the rank's code opened itself (``mlflow.log_metric`` without a run
auto-creates one; ``mlflow.start_run()`` left open): they would stay RUNNING forever. So,
before the rank exits, `RankRuns.end` flushes MLflow's asynchronous queues and ends the
rank's active fluent runs, innermost first, FINISHED when the rank succeeded and FAILED when it
raised (as the exit hook plus ``with mlflow.start_run()`` would under torchrun), stopping at
the call's own run (``MLFLOW_RUN_ID`` given by the caller), which only the caller ends.

Cheap when the rank never imported mlflow: nothing is imported here.
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger("gangrun.tracking")


class RankRuns:
    """Created when the rank starts, before user code runs: ``mlflow.start_run`` removes
    ``MLFLOW_RUN_ID`` from ``os.environ`` when it resumes that run, so the id of the call's own
    run is read now."""

    def __init__(self) -> None:
        self.call_run_id = os.environ.get("MLFLOW_RUN_ID") or None

    def end(self, succeeded: bool) -> None:
        mlflow = sys.modules.get("mlflow")
        if mlflow is None:
            return
        for name in ("flush_async_logging", "flush_artifact_async_logging"):
            fn = getattr(mlflow, name, None)
            if fn is not None:
                try:
                    fn()
                except Exception as exc:  # the data is lost either way; the rank still exits
                    log.warning("MLflow %s failed in the rank: %s", name, exc)
        status = "FINISHED" if succeeded else "FAILED"
        for _ in range(100):  # bounded: a run that refuses to end must not hang the exit
            try:
                active = mlflow.active_run()
            except Exception as exc:
                print(f"gangrun: could not read the rank's MLflow runs: {exc}", file=sys.stderr)
                return
            if active is None or active.info.run_id == self.call_run_id:
                return
            try:
                mlflow.end_run(status)  # pops the run first: a failure here moves on
            except Exception as exc:
                print(
                    f"gangrun: could not end MLflow run {active.info.run_id} of this rank: {exc}",
                    file=sys.stderr,
                )
