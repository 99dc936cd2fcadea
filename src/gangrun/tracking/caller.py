"""MLflow tracking for a call, caller side (mlflow is imported lazily, only when tracking is on).

Interface used by the run: ``Tracker.start(info, stdout)`` (``info``: a `TrackingInfo`) before launch (returns ``None`` when
MLflow is unavailable; raises ``LaunchError`` on bad tracking input), ``tracker.rank_env()``
for the ranks, ``tracker.finish(status, error, logs)`` once the call is over. Only the caller
ever ends the call's run.

The run is created (or resumed) with ``MlflowClient`` (never the fluent ``start_run``), so the
caller's own fluent run stack is left exactly as it was; when the caller has an active run the
new run is its child (``mlflow.parentRunId``). Ranks get ``MLFLOW_RUN_ID``/
``MLFLOW_TRACKING_URI``/``MLFLOW_EXPERIMENT_ID``: MLflow's fluent API in a rank then *resumes*
this run, and the rank's exit hook (`gangrun.rank.tracking`) never ends it there.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

from ..errors import DistributedError, LaunchError
from ..wire.security import credentials, redact
from ..wire.tags import (
    TAG_ERROR,
    TAG_ERROR_RANK,
    TAG_ERROR_TYPE,
    TAG_RESUMES,
    TAG_RUN_ID,
    TAG_STATUS_REASON,
)
from . import lease
from .bounded import HealthWatch, TrackingTimeout, bounded, is_server, probe
from .plan import (
    RunPlan,
    TrackingInfo,
    context_tags,
    plan_run,
    resolve_log_system_metrics,
    scalar_str,
)
from .plan import resolve_tracking_uri as resolve_tracking_uri
from .plan import run_link as run_link

log = logging.getLogger("gangrun.tracking")

_ERROR_TAGS = (TAG_ERROR, TAG_ERROR_TYPE, TAG_ERROR_RANK, TAG_STATUS_REASON)
_MAX_TAG = 5000  # MLflow accepts 8000 characters per tag value; keep well below


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
        self.resume_number = 0  # 0: a run of its own; N: the Nth call that resumed this run
        self.resumed_tags: dict[str, str] | None = None  # a resumed run's, when it was taken
        self._monitor: Any = None
        self._finished = False
        self.call_id = ""  # the gangrun call holding the run's lease (tracking/lease.py)
        self._stream: Any = None  # where the link was printed: the finishing note goes there
        self._watch: HealthWatch | None = None

    # ------------------------------------------------------------------ start
    @classmethod
    def start(cls, info: TrackingInfo, stdout: Any) -> Tracker | None:
        """Create (or resume) the run and print its link.

        Raises ``LaunchError`` for bad tracking input (a run to resume that does not exist, an
        experiment that does not match it). Returns ``None``, after a one-line note, when
        MLflow is not installed or its store cannot be used: tracking must never stop the
        training itself.
        """
        opts = info.options
        try:
            with warnings.catch_warnings():
                # `import mlflow` imports tqdm.auto, which warns in a kernel without ipywidgets
                warnings.filterwarnings("ignore", message="IProgress not found")
                import mlflow
                from mlflow.tracking import MlflowClient
        except ImportError:
            resume_id = opts.run_id if opts is not None else None
            if resume_id is not None:
                raise LaunchError(
                    f"run_id={resume_id!r} resumes an MLflow run, but mlflow is not installed "
                    "here: pip install mlflow (or drop run_id=)."
                ) from None
            _note(
                stdout,
                "gangrun: mlflow is not installed, so this call is not tracked "
                "(pip install mlflow, or pass mlflow=False to silence this).",
            )
            return None
        uri = resolve_tracking_uri(mlflow.get_tracking_uri())
        why = probe(uri)  # a server that is not running: known in seconds, no MLflow retries
        if why is not None:
            _note(
                stdout,
                f"gangrun: MLflow tracking is off for this call, the tracking server {uri} "
                f"cannot be reached ({why}).",
            )
            return None
        half: list[Tracker] = []  # the run once created, to end it if the set-up fails
        # the caller's active fluent run is thread-local in MLflow: read here, not in setup()
        active = mlflow.active_run()
        fluent = SimpleNamespace(active_run=lambda: active)

        def setup() -> Tracker:
            try:
                with quiet_store():  # MLflow's INFO lines on a new store stay out of the cell
                    client = MlflowClient(tracking_uri=uri)
                    plan = plan_run(opts, info, fluent, client, uri)
                    tracker = cls._open(client, plan, info, half)
                tracker._log_params(info, plan)
                if resolve_log_system_metrics(opts, info.processes):
                    tracker._start_system_metrics(stdout)
                return tracker
            except BaseException as exc:
                if half:  # half set up (or interrupted): do not leave it RUNNING
                    _end_half(half[0], exc)
                raise

        def too_late(tracker: Tracker) -> None:  # the caller gave up waiting: end it
            tracker.finish("KILLED", TrackingTimeout("the call went on untracked"), {})

        try:
            tracker = bounded(setup, "start", on_late=too_late)
        except LaunchError:
            raise
        except Exception as exc:
            _note(
                stdout,
                f"gangrun: MLflow tracking is off for this call, the store could not be used "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}).",
            )
            return None
        try:
            link = run_link(
                uri, tracker.experiment_id, tracker.run_id or "", tracker.resume_number > 0
            )
            _note(stdout, link)
            tracker._stream = stdout
            if is_server(uri):
                tracker._watch = HealthWatch(uri, stdout)
        except BaseException as exc:  # Ctrl-C before the call holds the run: not RUNNING
            _end_half(tracker, exc)
            raise
        return tracker

    @classmethod
    def _open(cls, client: Any, plan: RunPlan, info: TrackingInfo, half: list[Tracker]) -> Tracker:
        opts = info.options
        tags = _run_tags(info, plan.parent_run_id)
        call_id = info.run_id
        tags[lease.TAG_LEASE] = lease.value(call_id)
        tags.update({str(k): str(v) for k, v in (opts.tags if opts is not None else {}).items()})
        resume = plan.resume_run
        if resume is None:
            tags = {**context_tags(info.source), **tags}
            run = client.create_run(
                experiment_id=plan.experiment_id, tags=tags, run_name=plan.run_name
            )
            tracker = cls(client, run.info.run_id, plan.experiment_id, plan.tracking_uri)
            tracker.parent_run_id = plan.parent_run_id
            tracker.call_id = call_id
            lease.hold(call_id)
            half.append(tracker)
        else:
            run_id = resume.info.run_id
            where = ("run_id=" if plan.resume_source == "run_id=" else "MLFLOW_RUN_ID=") + repr(
                run_id
            )
            with lease.exclusive(run_id):  # check, take, verify: one call of this host at once
                if info.check_resume is not None:  # refused before anything of it changes
                    lease.check(resume, where)  # a live call's run: that refusal first
                    info.check_resume(run_id, dict(resume.data.tags))
                resume = lease.take(client, run_id, tags.pop(lease.TAG_LEASE), call_id, where)
                tracker = cls(client, run_id, plan.experiment_id, plan.tracking_uri)
                tracker.call_id = call_id
                tracker.resumed_tags = dict(resume.data.tags)  # where its checkpoints are
                half.append(tracker)
                tracker.resume_number = int(resume.data.tags.get(TAG_RESUMES, "0") or 0) + 1
                # back to RUNNING first: from here on finish() ends it whatever happens
                client.update_run(run_id, status="RUNNING", name=plan.run_name)
            for key in _ERROR_TAGS:  # the failed attempt's error no longer describes the run
                if key in resume.data.tags:
                    client.delete_tag(run_id, key)
            tags.pop("mlflow.parentRunId", None)  # a resumed run keeps its own parent
            tags[TAG_RESUMES] = str(tracker.resume_number)
            _set_tags(client, run_id, tags)
        try:
            tracker.experiment_name = client.get_experiment(plan.experiment_id).name
        except Exception as exc:  # only the ranks' MLFLOW_EXPERIMENT_NAME is missing then
            log.debug(
                "experiment %s has no readable name: %s", plan.experiment_id, redact(str(exc))
            )
        return tracker

    def _log_params(self, info: TrackingInfo, plan: RunPlan) -> None:
        from mlflow.entities import Param

        params = {k: scalar_str(v) for k, v in info.params().items()}
        for k, v in info.args.items():
            name = k if k not in params else f"arg.{k}"
            params[name] = scalar_str(v)
        if plan.resume_run is not None:
            # MLflow params are immutable: keep the run's values; a resumed call's differing
            # values are logged as resume<N>.<name>, new names as they are.
            old = plan.resume_run.data.params
            prefix = f"resume{self.resume_number}."
            params = {
                (k if k not in old else prefix + k): v for k, v in params.items() if old.get(k) != v
            }
        if params:
            self.client.log_batch(
                self.run_id, params=[Param(k, v) for k, v in params.items()], synchronous=True
            )

    def _start_system_metrics(self, stdout: Any) -> None:
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            mon = SystemMetricsMonitor(
                self.run_id,
                tracking_uri=self.tracking_uri,
                resume_logging=self.resume_number > 0,
            )
            mon.start()
            self._monitor = mon
        except Exception as exc:
            _note(stdout, f"gangrun: system metrics are not logged: {exc}")

    def watch_rank_memory(self, run_dir: str, world_size: int) -> None:
        """Each rank's memory among the system metrics, when they are logged (once per run
        directory: an attempt after a restart keeps the same)."""
        from .memory import RankMemoryMonitor

        mon = self._monitor
        try:
            if mon is not None and not any(
                isinstance(m, RankMemoryMonitor) and m.run_dir == run_dir for m in mon.monitors
            ):
                mon.monitors.append(RankMemoryMonitor(run_dir, world_size))
        except AttributeError as exc:  # an MLflow whose monitor keeps no list of monitors
            log.debug("the ranks' memory is not among the system metrics: %s", exc)

    # ------------------------------------------------------------------ ranks
    def rank_env(self) -> dict[str, str]:
        env = {
            "MLFLOW_RUN_ID": str(self.run_id),
            "MLFLOW_TRACKING_URI": self.tracking_uri,
            "MLFLOW_EXPERIMENT_ID": str(self.experiment_id),
        }
        clean, user, password = credentials(self.tracking_uri)
        if user is not None and not any(os.environ.get(k) for k in _CREDENTIAL_VARS):
            # MLflow's own variables carry them: the URI a rank sees, prints or shows in
            # MLflow's "View run" lines holds no password
            env["MLFLOW_TRACKING_URI"] = clean
            env["MLFLOW_TRACKING_USERNAME"] = user
            env["MLFLOW_TRACKING_PASSWORD"] = password or ""
        if self.experiment_name is not None:
            env["MLFLOW_EXPERIMENT_NAME"] = self.experiment_name
        return env

    # ------------------------------------------------------------------ finish
    def finish(self, status: str, error: BaseException | None, log_files: dict[int, str]) -> None:
        """Attach the rank logs, record the root cause and end the run with ``status``
        (FINISHED, FAILED or KILLED). Safe to call more than once (the first call wins).

        Bounded in time: a tracking server that went away is found by one short probe and
        nothing more is sent to it; every request is made within ``GANGRUN_TRACKING_TIMEOUT``.
        Either way a one-line note says the run could not be finished."""
        if self._finished:
            return
        self._finished = True
        lease.release(self.call_id)
        if self._watch is not None:
            self._watch.stop()
        why = probe(self.tracking_uri)
        if why is None:
            try:
                bounded(lambda: self._finish(status, error, log_files), "finish")
                return
            except TrackingTimeout as exc:
                why = str(exc)
        if self._monitor is not None:  # stop its sampling; its last request ends on its own
            threading.Thread(
                target=self._monitor.finish, name="gangrun-tracking-sysmetrics", daemon=True
            ).start()
        where = (
            f"the tracking server {self.tracking_uri} cannot be reached"
            if is_server(self.tracking_uri)
            else f"the tracking store {self.tracking_uri} did not answer in time"
        )
        _note(
            self._stream or sys.stderr,
            f"gangrun: the MLflow run {self.run_id} could not be finished: {where} ({why}); "
            "it stays RUNNING there. The call's results are not affected.",
        )

    def _finish(self, status: str, error: BaseException | None, log_files: dict[int, str]) -> None:
        problems: list[str] = []
        if self._monitor is not None:
            try:
                self._monitor.finish()
            except Exception as exc:
                problems.append(f"system metrics: {exc}")
        logs_at = "logs" if not self.resume_number else f"logs/resume{self.resume_number}"
        for rank, path in sorted(log_files.items()):
            try:
                if os.path.exists(path):
                    self.client.log_artifact(self.run_id, path, artifact_path=logs_at)
            except Exception as exc:
                problems.append(f"log of rank {rank}: {exc}")
        tags: dict[str, str] = {}
        if error is not None:
            text = str(error) or type(error).__name__
            tags[TAG_ERROR] = text if len(text) <= _MAX_TAG else text[: _MAX_TAG - 3] + "..."
            tags[TAG_ERROR_TYPE] = type(error).__name__
            err_rank = error.rank if isinstance(error, DistributedError) else None
            if err_rank is not None:
                tags[TAG_ERROR_RANK] = str(err_rank)
            if status == "KILLED":
                tags[TAG_STATUS_REASON] = text.splitlines()[0][:_MAX_TAG]
            try:
                self.client.log_text(self.run_id, text, "gangrun_error.txt")
            except Exception as exc:
                problems.append(f"error text: {exc}")
        problems += _set_tags(self.client, self.run_id, tags, strict=False)
        if self.call_id:
            try:
                self.client.delete_tag(self.run_id, lease.TAG_LEASE)
            except Exception as exc:  # a terminal status makes the lease stale anyway
                problems.append(f"tag {lease.TAG_LEASE}: {exc}")
        with _no_url_printed(self.tracking_uri):  # MLflow's "View run at <URI>" lines
            self.client.set_terminated(self.run_id, status, end_time=int(time.time() * 1000))
        if problems:
            text = redact("; ".join(problems))
            print(f"gangrun: the MLflow run is incomplete: {text}", file=sys.stderr)


# MLflow's own INFO lines on the first use of a store ("Creating initial MLflow database
# tables...", alembic's migrations) would land in the user's cell: held back while a call
# opens its run. Warnings and errors still pass.
_STORE_LOGGERS = (
    "mlflow.store.db.utils",
    "mlflow.store.db",
    "alembic",
    "alembic.runtime.migration",
)


@contextlib.contextmanager
def quiet_store() -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in _STORE_LOGGERS]
    before = [lg.level for lg in loggers]
    for lg in loggers:
        if lg.getEffectiveLevel() < logging.WARNING:
            lg.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for lg, level in zip(loggers, before, strict=True):
            lg.setLevel(level)


_CREDENTIAL_VARS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")
_SUPPRESS_URL = "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"
_quiet_lock = threading.Lock()
_quiet: dict[str, Any] = {"holders": 0, "before": None}  # the variable's value before them


@contextlib.contextmanager
def _no_url_printed(uri: str) -> Iterator[None]:
    """While ending a run whose tracking URI holds a password: MLflow's ``set_terminated``
    prints "View run ... at: <the URI>" on stdout, unless its variable says not to. The
    variable is set for the duration (process-wide: concurrent holders share it, the last
    one restores it); gangrun printed the run's link, redacted, when the run began."""
    if redact(uri) == uri:
        yield
        return
    with _quiet_lock:
        if not _quiet["holders"]:
            _quiet["before"] = os.environ.get(_SUPPRESS_URL)
            os.environ[_SUPPRESS_URL] = "true"
        _quiet["holders"] += 1
    try:
        yield
    finally:
        with _quiet_lock:
            _quiet["holders"] -= 1
            if not _quiet["holders"]:
                if _quiet["before"] is None:
                    os.environ.pop(_SUPPRESS_URL, None)
                else:
                    os.environ[_SUPPRESS_URL] = _quiet["before"]


def _end_half(tracker: Tracker, exc: BaseException) -> None:
    status = "FAILED" if isinstance(exc, Exception) else "KILLED"
    try:
        tracker.finish(status, exc, {})
    except Exception as inner:
        log.warning("could not end the half-created MLflow run: %s", redact(str(inner)))


def _set_tags(client: Any, run_id: Any, tags: dict[str, str], strict: bool = True) -> list[str]:
    """Set ``tags`` one by one; with ``strict=False`` the failures are returned, not raised."""
    problems: list[str] = []
    for k, v in tags.items():
        try:
            client.set_tag(run_id, k, v)
        except Exception as exc:
            if strict:
                raise
            problems.append(f"tag {k}: {exc}")
    return problems


def _note(stream: Any, line: str) -> None:
    line = redact(line)  # a tracking URI's password, in it or in an error's text
    try:
        stream.write(line + "\n")
        stream.flush()
    except Exception as exc:  # the caller's stdout is closed: the line goes to the log only
        log.info("%s (stdout unusable: %s)", line, exc)


def _run_tags(info: TrackingInfo, parent_id: str | None) -> dict[str, str]:
    tags = {**info.tags(), TAG_RUN_ID: info.run_id}
    if parent_id is not None:
        tags["mlflow.parentRunId"] = parent_id
    return tags
