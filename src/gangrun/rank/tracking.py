"""Rank side of tracking: end the MLflow runs a rank's own code opened, before it exits.

A rank leaves with ``os._exit`` (see `gangrun.rank.worker`), which skips MLflow's exit hook:
good for the call's own run (that hook would end it from a rank, while other ranks still log),
bad for every run the rank's code opened itself (``mlflow.log_metric`` without a run
auto-creates one; ``mlflow.start_run()`` left open): they would stay RUNNING forever. So,
before the rank exits, `RankRuns.end` flushes MLflow's asynchronous queues and ends the
rank's active fluent runs, innermost first, FINISHED when the rank succeeded and FAILED when it
raised (as the exit hook plus ``with mlflow.start_run()`` would under torchrun), stopping at
the call's own run (``MLFLOW_RUN_ID`` given by the caller), which only the caller ends.

Against a tracking *server* (``http(s)`` URI) a rank must keep training when the server goes
away: `bound_requests` (called when the rank starts, before user code) makes MLflow's
fluent logging asynchronous and its HTTP retries short, unless the user's environment already
says otherwise (``MLFLOW_ENABLE_ASYNC_LOGGING``, ``MLFLOW_HTTP_REQUEST_MAX_RETRIES``,
``..._BACKOFF_FACTOR``, ``..._TIMEOUT``): ``mlflow.log_metric`` returns at once, a batch the
server cannot take is dropped after a few seconds, and MLflow's per-batch error lines for an
unreachable server are kept out of the rank's output (the caller says once that metrics are
being lost). The flush before the rank exits is bounded in time too.

Cheap when the rank never imported mlflow: nothing is imported here.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

log = logging.getLogger("gangrun.tracking")

# MLflow's settings for a rank that logs to a tracking server (unless the user set them).
SERVER_DEFAULTS = {
    "MLFLOW_ENABLE_ASYNC_LOGGING": "true",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "15",
}
FLUSH_TIMEOUT = 10.0  # seconds the rank waits for MLflow's queues before it exits
_UNREACHABLE = (
    "Max retries exceeded",
    "Connection refused",
    "Failed to establish a new connection",
    "Connection aborted",
    "RemoteDisconnected",
    "timed out",
)


class _DropUnreachable(logging.Filter):
    """Drops MLflow's async-queue errors that only say the server cannot be reached."""

    def __init__(self) -> None:
        super().__init__()
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            text = record.getMessage()
        except Exception:
            return True
        if "Failed to log run data" in text and any(s in text for s in _UNREACHABLE):
            self.dropped += 1
            return False
        return True


def bound_requests(environ: dict[str, str] | None = None) -> bool:
    """For a tracking server: MLflow's logging made asynchronous and its retries short (the
    user's own settings win); True when applied."""
    env = os.environ if environ is None else environ
    uri = env.get("MLFLOW_TRACKING_URI", "")
    if not uri.startswith(("http://", "https://")):
        return False
    for k, v in SERVER_DEFAULTS.items():
        env.setdefault(k, v)
    logging.getLogger("mlflow.utils.async_logging.async_logging_queue").addFilter(
        _DropUnreachable()
    )
    return True


def _bounded_flush(fn: object, name: str) -> None:
    """``fn()`` (an MLflow flush), waited for at most `FLUSH_TIMEOUT` seconds: what a
    vanished server did not take is lost either way, and the rank must exit."""

    def run() -> None:
        try:
            fn()  # type: ignore[operator]
        except Exception as exc:  # the data is lost either way; the rank still exits
            log.warning("MLflow %s failed in the rank: %s", name, exc)

    t = threading.Thread(target=run, name=f"gangrun-{name}", daemon=True)
    t.start()
    t.join(FLUSH_TIMEOUT)
    if t.is_alive():
        log.info("MLflow %s did not finish within %gs: the rest is dropped", name, FLUSH_TIMEOUT)


class RankRuns:
    """Created when the rank starts, before user code runs: ``mlflow.start_run`` removes
    ``MLFLOW_RUN_ID`` from ``os.environ`` when it resumes that run, so the id of the call's own
    run is read now."""

    def __init__(self) -> None:
        self.call_run_id = os.environ.get("MLFLOW_RUN_ID") or None
        bound_requests()

    def end(self, succeeded: bool) -> None:
        mlflow = sys.modules.get("mlflow")
        if mlflow is None:
            return
        flush = getattr(mlflow, "flush_async_logging", None)
        if flush is not None:  # metrics, params, tags: bounded in time (see module doc)
            _bounded_flush(flush, "flush_async_logging")
        try:
            # In this thread: it reads the thread-local active run, and starts one when there
            # is none (a request; a new run with mlflow=False), so only with a run active.
            if mlflow.active_run() is not None and hasattr(mlflow, "flush_artifact_async_logging"):
                mlflow.flush_artifact_async_logging()
        except Exception as exc:  # the data is lost either way; the rank still exits
            log.warning("MLflow flush_artifact_async_logging failed in the rank: %s", exc)
        status = "FINISHED" if succeeded else "FAILED"
        from ..wire.security import redact

        uri = os.environ.get("MLFLOW_TRACKING_URI", "")
        if redact(uri) != uri:  # ending a run, MLflow prints its link: not with a password
            os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
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
