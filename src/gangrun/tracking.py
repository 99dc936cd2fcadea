"""MLflow tracking for a call (mlflow is imported lazily, only when tracking is on).

Interface used by the run: ``Tracker.start(info, stdout)`` before launch (returns ``None`` when
MLflow is unavailable), ``tracker.rank_env()`` for the ranks, ``tracker.finish(status, error,
logs)`` once the call is over. Only the caller ever ends the run.

The run is created with ``MlflowClient`` (never the fluent ``start_run``), so the caller's own
fluent run stack is left exactly as it was; when the caller has an active run the new run is
its child (``mlflow.parentRunId``). Ranks get ``MLFLOW_RUN_ID``/``MLFLOW_TRACKING_URI``/
``MLFLOW_EXPERIMENT_ID``: MLflow's fluent API in a rank then *resumes* this run, and because a
rank ends with ``os._exit`` (see ``worker.py``) MLflow's exit hook never ends it from there.
"""

from __future__ import annotations

import os
import shlex
import sys
import time
import warnings
from typing import Any
from urllib.parse import urlparse

# Tag and param names gangrun writes on the run.
TAG_ERROR = "gangrun.error"
TAG_ERROR_TYPE = "gangrun.error_type"
TAG_ERROR_RANK = "gangrun.error_rank"
TAG_STATUS_REASON = "gangrun.status_reason"
TAG_RUN_ID = "gangrun.run_id"
_MAX_TAG = 5000  # MLflow accepts 8000 characters per tag value; keep well below
_MAX_PARAM = 500


def resolve_tracking_uri(uri: str, cwd: str | None = None) -> str:
    """``uri`` with any relative local path made absolute, so ranks reach the same store."""
    base = cwd or os.getcwd()
    if uri.startswith("sqlite:///"):
        rest = uri[len("sqlite:///") :]
        path, sep, query = rest.partition("?")
        if path and path != ":memory:" and not path.startswith("/"):
            return "sqlite:///" + os.path.abspath(os.path.join(base, path)) + sep + query
        return uri
    parsed = urlparse(uri)
    if uri == "databricks" or uri.startswith("databricks-uc"):
        return uri
    if parsed.scheme == "":
        return os.path.abspath(os.path.join(base, uri))
    if parsed.scheme == "file" and not parsed.netloc:
        path = uri[len("file:") :].lstrip()
        if path.startswith("//"):
            path = path[2:]
        if not path.startswith("/"):
            return "file://" + os.path.abspath(os.path.join(base, path))
    return uri


def run_link(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    """The line printed for a run: a UI URL for a server, else the id and the ``mlflow ui``
    command that shows the store."""
    scheme = urlparse(tracking_uri).scheme
    if scheme in ("http", "https"):
        url = f"{tracking_uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"
        return f"gangrun: MLflow run {run_id}: {url}"
    if scheme.startswith("databricks"):
        return f"gangrun: MLflow run {run_id} (experiment {experiment_id}) on {tracking_uri}"
    return (
        f"gangrun: MLflow run {run_id} (experiment {experiment_id}). View it with: "
        f"mlflow ui --backend-store-uri {shlex.quote(tracking_uri)}  then open "
        f"http://127.0.0.1:5000/#/experiments/{experiment_id}/runs/{run_id}"
    )


def _scalar_str(v: Any) -> str:
    s = str(v)
    return s if len(s) <= _MAX_PARAM else s[: _MAX_PARAM - 3] + "..."


class Tracker:
    """The MLflow run of one call, owned by the caller."""

    run_id: str | None = None

    def __init__(self, client: Any, run_id: str, experiment_id: str, tracking_uri: str) -> None:
        self.client = client
        self.run_id = run_id
        self.experiment_id = experiment_id
        self.tracking_uri = tracking_uri
        self.experiment_name: str | None = None
        self.parent_run_id: str | None = None
        self._monitor: Any = None
        self._finished = False

    # ------------------------------------------------------------------ start
    @classmethod
    def start(cls, info: dict[str, Any], stdout: Any) -> Tracker | None:
        """Create the run (nested under the caller's active run, if any) and print its link.

        Returns ``None``, after a one-line note, when MLflow is not installed or its store
        cannot be reached: tracking must never stop the training itself.
        """
        try:
            with warnings.catch_warnings():
                # `import mlflow` imports tqdm.auto, which warns in a kernel without ipywidgets
                warnings.filterwarnings("ignore", message="IProgress not found")
                import mlflow
                from mlflow.tracking import MlflowClient
        except ImportError:
            _note(
                stdout,
                "gangrun: mlflow is not installed, so this call is not tracked "
                "(pip install mlflow, or pass mlflow=False to silence this).",
            )
            return None
        tracker: Tracker | None = None
        try:
            uri = resolve_tracking_uri(mlflow.get_tracking_uri())
            client = MlflowClient(tracking_uri=uri)
            parent_id, experiment_id = _parent_and_experiment(mlflow, client)
            tags = _run_tags(info, parent_id)
            try:
                from mlflow.tracking.context import registry as context_registry

                tags = context_registry.resolve_tags(tags)  # user, source, git commit
            except Exception:
                pass
            run = client.create_run(
                experiment_id=experiment_id, tags=tags, run_name=str(info.get("function"))
            )
            tracker = cls(client, run.info.run_id, experiment_id, uri)
            tracker.parent_run_id = parent_id
            try:
                tracker.experiment_name = client.get_experiment(experiment_id).name
            except Exception:
                pass
            tracker._log_params(info)
            if info.get("log_system_metrics"):
                tracker._start_system_metrics(stdout)
        except BaseException as exc:
            if tracker is not None:  # half set up (or interrupted): do not leave it RUNNING
                status = "FAILED" if isinstance(exc, Exception) else "KILLED"
                try:
                    tracker.finish(status, exc, {})
                except Exception:
                    pass
            if not isinstance(exc, Exception):
                raise
            _note(
                stdout,
                f"gangrun: MLflow tracking is off for this call, the store could not be used "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}).",
            )
            return None
        _note(stdout, run_link(uri, experiment_id, tracker.run_id or ""))
        return tracker

    def _log_params(self, info: dict[str, Any]) -> None:
        from mlflow.entities import Param

        params: dict[str, str] = {}
        for key in ("function", "world_size", "processes", "gpus", "gpu_type", "timeout"):
            v = info.get(key)
            if v is not None:
                params[key] = _scalar_str(v)
        for k, v in (info.get("args") or {}).items():
            name = k if k not in params else f"arg.{k}"
            params[name] = _scalar_str(v)
        if params:
            self.client.log_batch(
                self.run_id, params=[Param(k, v) for k, v in params.items()], synchronous=True
            )

    def _start_system_metrics(self, stdout: Any) -> None:
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            mon = SystemMetricsMonitor(self.run_id, tracking_uri=self.tracking_uri)
            mon.start()
            self._monitor = mon
        except Exception as exc:
            _note(stdout, f"gangrun: system metrics are not logged: {exc}")

    # ------------------------------------------------------------------ ranks
    def rank_env(self) -> dict[str, str]:
        env = {
            "MLFLOW_RUN_ID": str(self.run_id),
            "MLFLOW_TRACKING_URI": self.tracking_uri,
            "MLFLOW_EXPERIMENT_ID": str(self.experiment_id),
        }
        if self.experiment_name is not None:
            env["MLFLOW_EXPERIMENT_NAME"] = self.experiment_name
        return env

    # ------------------------------------------------------------------ finish
    def finish(self, status: str, error: BaseException | None, log_files: dict[int, str]) -> None:
        """Attach the rank logs, record the root cause and end the run with ``status``
        (FINISHED, FAILED or KILLED). Safe to call more than once (the first call wins)."""
        if self._finished:
            return
        self._finished = True
        problems: list[str] = []
        if self._monitor is not None:
            try:
                self._monitor.finish()
            except Exception as exc:
                problems.append(f"system metrics: {exc}")
        for rank, path in sorted(log_files.items()):
            try:
                if os.path.exists(path):
                    self.client.log_artifact(self.run_id, path, artifact_path="logs")
            except Exception as exc:
                problems.append(f"log of rank {rank}: {exc}")
        tags: dict[str, str] = {}
        if error is not None:
            text = str(error) or type(error).__name__
            tags[TAG_ERROR] = text if len(text) <= _MAX_TAG else text[: _MAX_TAG - 3] + "..."
            tags[TAG_ERROR_TYPE] = type(error).__name__
            err_rank = getattr(error, "rank", None)
            if err_rank is not None:
                tags[TAG_ERROR_RANK] = str(err_rank)
            if status == "KILLED":
                tags[TAG_STATUS_REASON] = text.splitlines()[0][:_MAX_TAG]
            try:
                self.client.log_text(self.run_id, text, "gangrun_error.txt")
            except Exception as exc:
                problems.append(f"error text: {exc}")
        for k, v in tags.items():
            try:
                self.client.set_tag(self.run_id, k, v)
            except Exception as exc:
                problems.append(f"tag {k}: {exc}")
        self.client.set_terminated(self.run_id, status, end_time=int(time.time() * 1000))
        if problems:
            print("gangrun: the MLflow run is incomplete: " + "; ".join(problems), file=sys.stderr)


def _note(stream: Any, line: str) -> None:
    try:
        stream.write(line + "\n")
        stream.flush()
    except Exception:
        pass


def _parent_and_experiment(mlflow: Any, client: Any) -> tuple[str | None, str]:
    """The caller's active run (if any) and the experiment the new run belongs in."""
    active = mlflow.active_run()
    parent_id: str | None = None
    if active is not None:
        return active.info.run_id, active.info.experiment_id
    env_run = os.environ.get("MLFLOW_RUN_ID")
    if env_run:  # e.g. a script started by `mlflow run`: its run is the parent
        try:
            parent = client.get_run(env_run)
            return parent.info.run_id, parent.info.experiment_id
        except Exception:
            pass
    try:
        from mlflow.tracking.fluent import _get_experiment_id

        experiment_id = _get_experiment_id()
    except Exception:
        experiment_id = None
    return parent_id, str(experiment_id if experiment_id is not None else "0")


def _run_tags(info: dict[str, Any], parent_id: str | None) -> dict[str, str]:
    tags = {
        "gangrun.function": str(info.get("function")),
        "gangrun.world_size": str(info.get("world_size")),
        "gangrun.version": str(info.get("version")),
        "gangrun.host": str(info.get("host")),
        TAG_RUN_ID: str(info.get("run_id")),
    }
    for key in ("processes", "gpus", "gpu_type", "timeout"):
        if info.get(key) is not None:
            tags[f"gangrun.{key}"] = str(info[key])
    if parent_id is not None:
        tags["mlflow.parentRunId"] = parent_id
    return tags


def flush_in_rank() -> None:
    """``worker.before_exit`` hook: a rank leaves with ``os._exit``, which skips MLflow's exit
    hook (good: that hook would end the run) but also its flushes. Flush what the user's code
    queued with asynchronous logging; never end the run."""
    mlflow = sys.modules.get("mlflow")
    if mlflow is None:
        return
    for name in ("flush_async_logging", "flush_artifact_async_logging"):
        fn = getattr(mlflow, name, None)
        if fn is not None:
            try:
                fn()
            except Exception:
                pass
