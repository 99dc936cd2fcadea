"""Where a call's MLflow run goes: store, experiment, parent, new or resumed run (caller side).

Everything here runs in the caller before any rank starts, so bad input (a ``run_id`` that does
not exist, an ``experiment_name`` that is not the resumed run's experiment) is a
[`LaunchError`][gangrun.errors.LaunchError] while nothing runs yet. Only MLflow's public API is used.

How the run is chosen (see docs/tracking.md):

* resume: ``run_id=`` if given; else ``MLFLOW_RUN_ID`` from the caller's environment when the
  caller has no active fluent run (MLflow's own convention);
* otherwise a new run, named ``run_name=`` (default: the function's name), the child of the
  caller's active fluent run if there is one, in experiment ``experiment_name=`` (created if
  missing), else the parent's experiment, else the caller's active experiment
  (``mlflow.set_experiment`` sets ``MLFLOW_EXPERIMENT_ID``; or ``MLFLOW_EXPERIMENT_NAME``),
  else the store's default experiment ``"0"``.
"""

from __future__ import annotations

import inspect
import os
import shlex
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from ..errors import LaunchError
from ..wire import tags as names
from ..wire.security import redact

if TYPE_CHECKING:
    from ..options import Options

_MAX_PARAM = 500
_SCALARS = (int, float, str, bool, type(None))


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


def run_link(tracking_uri: str, experiment_id: str, run_id: str, resumed: bool = False) -> str:
    """The line printed for a run: a UI URL for a server, else the id and the ``mlflow ui``
    command that shows the store."""
    what = f"MLflow run {run_id}" + (" (resumed)" if resumed else "")
    scheme = urlparse(tracking_uri).scheme
    tracking_uri = redact(tracking_uri)  # shown: never a password
    if scheme in ("http", "https"):
        url = f"{tracking_uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"
        return f"gangrun: {what}: {url}"
    if scheme.startswith("databricks"):
        return f"gangrun: {what} (experiment {experiment_id}) on {tracking_uri}"
    # two lines that fit 100 columns (the UI lists the run under its experiment)
    return (
        f"gangrun: {what} (experiment {experiment_id}). View it with:\n"
        f"  mlflow ui --backend-store-uri {shlex.quote(tracking_uri)}"
    )


def scalar_str(v: Any) -> str:
    s = str(v)
    return s if len(s) <= _MAX_PARAM else s[: _MAX_PARAM - 3] + "..."


def call_arguments(fn: Callable[..., Any], args: tuple, kwargs: Mapping[str, Any]) -> dict:
    """The call's scalar arguments by parameter name (defaults included), for the run's params.

    ``inspect.signature(fn).bind``: a positional argument is logged under its parameter's name;
    ``*args`` items as ``args.0``, ``args.1``...; ``**kwargs`` items under their own keys.
    Non-scalar values (tensors, lists, objects) are left out.
    """
    out: dict[str, Any] = {}
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
        bound.apply_defaults()
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature (a builtin) or arguments that do not bind
        bound = None
    if bound is None:
        named = {f"args.{i}": v for i, v in enumerate(args)}
        named.update(kwargs)
        return {k: v for k, v in named.items() if isinstance(v, _SCALARS)}
    for name, value in bound.arguments.items():
        kind = params[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            out.update({f"{name}.{i}": v for i, v in enumerate(value)})
        elif kind is inspect.Parameter.VAR_KEYWORD:
            out.update({str(k): v for k, v in value.items() if str(k) not in params})
        else:
            out[name] = value
    return {k: v for k, v in out.items() if isinstance(v, _SCALARS)}


@dataclass(frozen=True)
class TrackingInfo:
    """What the MLflow run records about one call (params and tags), made once by the plan
    (`gangrun.lifecycle.plan.tracking_info`)."""

    function: str
    world_size: int
    run_id: str  # the gangrun call's id (the lease, gangrun.run_id)
    options: Options | None = None  # experiment_name, run_name, run_id, tags, system metrics
    processes: int | None = None
    gpus: int | list[int] | None = None  # None for processes= calls
    gpu_type: str | None = None  # the accelerator found, else the option
    timeout: float | None = None
    version: str = ""
    host: str = ""
    args: dict[str, Any] = field(default_factory=dict)  # the call's arguments, by parameter
    source: str | None = None  # the file the call runs (gangrun run: the script)
    backend: str | None = None  # "ray"; None on this node
    # (run id, tags) of a run to resume -> a LaunchError refusing it: called before the run is
    # touched, so a refused call leaves it as it was (the call's checkpoints: their location)
    check_resume: Callable[[str, dict[str, str]], None] | None = field(
        default=None, repr=False, compare=False
    )

    def params(self) -> dict[str, Any]:
        """The call's own MLflow params (before its arguments), ``None`` values left out."""
        return {k: v for k in names.PARAM_KEYS if (v := getattr(self, k)) is not None}

    def tags(self) -> dict[str, str]:
        """The ``gangrun.*`` tags of the run (without the parent and the lease)."""
        tags = {
            names.TAG_FUNCTION: str(self.function),
            names.TAG_WORLD_SIZE: str(self.world_size),
            names.TAG_VERSION: str(self.version),
            names.TAG_HOST: str(self.host),
        }
        for key in names.CALL_TAG_KEYS:
            value = getattr(self, key)
            if value is not None:
                tags[names.PREFIX + key] = str(value)
        return tags


@dataclass
class RunPlan:
    """What `Tracker.start` will do: create a run, or resume ``resume_run``."""

    tracking_uri: str
    experiment_id: str
    run_name: str | None
    parent_run_id: str | None = None
    resume_run: Any = None  # mlflow.entities.Run of the run to resume
    resume_source: str = ""  # "run_id=" or "MLFLOW_RUN_ID"
    tags: dict[str, str] = field(default_factory=dict)


def _not_found(exc: Exception) -> bool:
    code = getattr(exc, "error_code", "")
    return code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND")


def _experiment_by_name(client: Any, name: str, create: bool) -> Any:
    exp = client.get_experiment_by_name(name)
    if exp is None and create:
        try:
            client.create_experiment(name)
        except Exception:
            if client.get_experiment_by_name(name) is None:  # not a concurrent creation
                raise
        exp = client.get_experiment_by_name(name)
    if exp is not None and exp.lifecycle_stage == "deleted":
        raise LaunchError(
            f"experiment_name={name!r} names a deleted experiment (id {exp.experiment_id}). "
            f"Restore it (mlflow experiments restore --experiment-id {exp.experiment_id}) or "
            "choose another name."
        )
    return exp


def _active_experiment(client: Any) -> str:
    """The caller's active experiment without MLflow's private helpers: ``set_experiment``
    exports ``MLFLOW_EXPERIMENT_ID`` (so subprocesses inherit it), which wins over
    ``MLFLOW_EXPERIMENT_NAME``; with neither, the default experiment ``"0"``."""
    exp_id = os.environ.get("MLFLOW_EXPERIMENT_ID")
    if exp_id:
        return str(client.get_experiment(exp_id).experiment_id)
    name = os.environ.get("MLFLOW_EXPERIMENT_NAME")
    if name:
        return str(_experiment_by_name(client, name, create=True).experiment_id)
    return "0"


def _resume_target(opts: Options | None, client: Any, uri: str, active: Any) -> tuple[Any, str]:
    """The run to resume (``None`` for a new run) and where its id came from."""
    run_id = opts.run_id if opts is not None else None
    source = "run_id="
    if run_id is None and active is None and os.environ.get("MLFLOW_RUN_ID"):
        run_id, source = os.environ["MLFLOW_RUN_ID"], "MLFLOW_RUN_ID"
    if run_id is None:
        return None, ""
    where = f"{source}{run_id!r}" if source == "run_id=" else f"MLFLOW_RUN_ID={run_id!r}"
    try:
        run = client.get_run(run_id)
    except Exception as exc:
        if not _not_found(exc):
            raise
        raise LaunchError(
            f"{where}: no such MLflow run in the tracking store {redact(uri)}. Check the id (the run "
            "page or mlflow.search_runs() shows it) and MLFLOW_TRACKING_URI / "
            "mlflow.set_tracking_uri()."
            + (" Unset MLFLOW_RUN_ID to start a new run." if source != "run_id=" else "")
        ) from None
    if run.info.lifecycle_stage == "deleted":
        raise LaunchError(
            f"{where}: that MLflow run is deleted (in {redact(uri)}). Restore it with "
            f"MlflowClient().restore_run({run_id!r}) or start a new run."
        )
    return run, source


def plan_run(
    opts: Options | None, info: TrackingInfo, mlflow: Any, client: Any, uri: str
) -> RunPlan:
    """Decide experiment, parent and run for the call (raises LaunchError on bad input)."""
    active = mlflow.active_run()
    exp_name = opts.experiment_name if opts is not None else None
    run_name = opts.run_name if opts is not None else None
    resume, source = _resume_target(opts, client, uri, active)
    if resume is not None:
        exp_id = str(resume.info.experiment_id)
        if exp_name is not None:
            exp = client.get_experiment_by_name(exp_name)
            if exp is None or str(exp.experiment_id) != exp_id:
                own = client.get_experiment(exp_id).name
                raise LaunchError(
                    f"run_id={resume.info.run_id!r} belongs to experiment {own!r} (id {exp_id}), "
                    f"not to experiment_name={exp_name!r}. Drop experiment_name= when resuming "
                    "(the run stays in its experiment) or pass its own experiment's name."
                )
        return RunPlan(uri, exp_id, run_name, resume_run=resume, resume_source=source)
    parent_id = None if active is None else str(active.info.run_id)
    if exp_name is not None:
        exp_id = str(_experiment_by_name(client, exp_name, create=True).experiment_id)
    elif active is not None:
        exp_id = str(active.info.experiment_id)
    else:
        exp_id = _active_experiment(client)
    return RunPlan(uri, exp_id, run_name or info.function, parent_run_id=parent_id)


def context_tags(source: str | None = None) -> dict[str, str]:
    """The source tags MLflow's fluent ``start_run`` would add: user, source, git commit.

    ``source``: the file the call runs (``gangrun run script.py``: the script, not the
    ``gangrun`` executable); default the caller's ``sys.argv[0]``, as MLflow does. The commit
    is that of the git repository holding that file, or no tag when it is in none."""
    tags: dict[str, str] = {"mlflow.source.type": "LOCAL"}
    try:
        import getpass

        tags["mlflow.user"] = getpass.getuser()
    except Exception:  # no user name for this uid (some containers): MLflow leaves it out too
        pass
    if not source:
        source = sys.argv[0] if sys.argv and sys.argv[0] else ""
    if source:
        tags["mlflow.source.name"] = source
    if "ipykernel" in sys.modules:
        tags["mlflow.source.type"] = "NOTEBOOK"
    if source and os.path.exists(source):
        try:
            import git  # GitPython, as MLflow's own git context uses

            repo = git.Repo(
                os.path.dirname(os.path.abspath(source)), search_parent_directories=True
            )
            tags["mlflow.source.git.commit"] = repo.head.commit.hexsha
        except Exception:  # no GitPython, no git, not a repository: no commit tag (as MLflow)
            pass
    return tags


def resolve_log_system_metrics(opts: Options | None, processes: int | None) -> bool:
    """``log_system_metrics=None`` means on for ``gpus=`` calls, off for ``processes=``."""
    value = opts.log_system_metrics if opts is not None else None
    if value is None:
        return processes is None
    return bool(value)
