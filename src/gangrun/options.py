"""The options of a distributed function (the decorator's keyword arguments).

Its own module, below `gangrun.api` and `gangrun.defaults` (which both read it).
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from .durations import finite_seconds as _seconds
from .durations import parse_duration
from .errors import LaunchError
from .wire import contract
from .wire.serialization import DEFAULT_MAX_CAPTURE_BYTES

DEFAULT_TIMEOUT = 10800.0
_OUTPUT_MODES = ("all", "rank0", "none")
_START_METHODS = ("auto", "spawn", "forkserver")
_BACKENDS = ("local", "ray")
DEFAULT_MAX_SHIP_BYTES = 100 << 20
RAY_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


def _setting(var: str, kind: str, builtin: Any) -> Any:
    """A group field defaulted by the environment variable ``var`` (read once per call, by
    `gangrun.defaults.resolve`), else ``builtin``. ``None`` in the field means "not set"."""
    return field(default=None, metadata={"env": var, "kind": kind, "builtin": builtin})


def setting(group: Any, name: str) -> Any:
    """Field ``name`` of an option group: its value, or its built-in default when unset."""
    value = getattr(group, name)
    return settings_of(group)[name]["builtin"] if value is None else value


def settings_of(group: Any) -> dict[str, dict[str, Any]]:
    """The fields of an option group (class or instance) that have a variable: name ->
    metadata (env, kind, builtin)."""
    cls = group if isinstance(group, type) else type(group)
    found = _SETTINGS.get(cls)
    if found is None:
        import dataclasses

        found = {f.name: dict(f.metadata) for f in dataclasses.fields(cls) if "env" in f.metadata}
        _SETTINGS[cls] = found
    return found


_SETTINGS: dict[type, dict[str, dict[str, Any]]] = {}


def _with_builtins(group: Any) -> Any:
    import dataclasses

    unset = {k: m["builtin"] for k, m in settings_of(group).items() if getattr(group, k) is None}
    return dataclasses.replace(group, **unset) if unset else group


def _names(value: Any) -> Any:
    """``"a, b"`` or a list -> ``("a", "b")`` (other values are left for `validate`)."""
    if isinstance(value, str):
        return tuple(x.strip() for x in value.split(",") if x.strip())
    if isinstance(value, list):
        return tuple(value)
    return value


def _seconds_or_none(group: Any, owner: str, name: str) -> None:
    """Check a group's duration field; one written as text (``"5m"``) becomes seconds."""
    v = getattr(group, name)
    if isinstance(v, str):
        try:
            v = parse_duration(v)
        except ValueError as exc:
            raise LaunchError(f"{owner}.{name}={getattr(group, name)!r}: {exc}.") from None
        if v is None:
            raise LaunchError(
                f"{owner}.{name} cannot be none: give a positive duration like 90s or 5m "
                "(or leave it out for the default)."
            )
        object.__setattr__(group, name, v)
    if v is not None and not _seconds(v, above=0):
        raise LaunchError(
            f"{owner}.{name} must be a positive number of seconds (finite), got {v!r}."
        )


# The options that are durations: name -> (None allowed, 0 means None). Each may be given as
# text in Python too (timeout="10m"), read by the parser of GANGRUN_TIMEOUT and --timeout.
DURATIONS: dict[str, tuple[bool, bool]] = {
    "timeout": (True, True),
    "hang_timeout": (True, True),
    "gpu_wait": (True, False),
    "grace_period": (False, False),
    "restart_backoff": (False, False),
    "restart_backoff_max": (False, False),
}
AUTO = frozenset({"hang_timeout"})  # may be "auto" (lifecycle/hang.py decides the seconds)
ZERO_IS_NONE = frozenset(n for n, (_, zero) in DURATIONS.items() if zero)


def duration_from_text(name: str, text: str) -> float | None:
    """Option ``name``'s value written as a duration (``"10m"``), as ``GANGRUN_<OPTION>`` and
    the command line read it: ``"none"`` (where allowed), ``"0"`` no limit for timeouts."""
    nullable, zero_is_none = DURATIONS[name]
    if name in AUTO and str(text).strip().lower() == "auto":
        return "auto"  # type: ignore[return-value]  # hang_timeout: from the step times seen
    try:
        value = parse_duration(text)
    except ValueError as exc:
        also = ", or auto" if name in AUTO else ""
        raise LaunchError(f"{name}={text!r}: {exc}{also}.") from None
    if value is None and not nullable:
        raise LaunchError(f"{name} cannot be none, give a duration like 90s or 5m.")
    if value == 0 and zero_is_none:
        return None
    return value


def _coerce_group(cls: Any, value: Any, option: str, listed: tuple[str, ...]) -> Any:
    if isinstance(value, cls):
        return value.validate()
    if value is None:
        return cls()
    if not isinstance(value, Mapping):
        raise LaunchError(
            f"{option} must be gangrun.{cls.__name__}(...) or a dict of its fields, got {value!r}."
        )
    import dataclasses

    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - names)
    if unknown:
        raise LaunchError(f"{option}: unknown field(s) {unknown}; valid: {sorted(names)}.")
    kw = dict(value)
    for name in listed:  # lists (from JSON) as tuples; the comma-separated settings split
        if isinstance(kw.get(name), list) or (name in settings_of(cls) and name in kw):
            kw[name] = _names(kw[name])
    return cls(**kw).validate()


# --- Ray option group -----------------------------------------------------------------
@dataclass(frozen=True)
class RayOptions:
    """How a ``backend="ray"`` call reaches its nodes (``Options.ray``; a dict is accepted).

    Attributes:
        ship: ship the caller's working directory and the local ``sys.path`` entries the
            function's modules come from (respecting ``.gitignore``) to nodes that lack
            them. ``False`` for nodes that already have the code (your own image).
        paths: further local directories to ship (each goes on the ranks' ``sys.path``).
        excludes: ``.gitignore``-style patterns left out of what ships.
        max_ship_bytes: limit on what ships (default 100 MiB; ``None``: no limit).
        pip: packages Ray installs for the ranks (its runtime env's ``pip``).
        env_vars: variables Ray sets in the rank actors (its runtime env's ``env_vars``).
        runtime_env: any other Ray runtime env keys, merged under the above (default:
            ``GANGRUN_RAY_RUNTIME_ENV``, JSON).
        strategy: the placement group's strategy, one of ``PACK`` (default), ``SPREAD``,
            ``STRICT_PACK``, ``STRICT_SPREAD`` (default: ``GANGRUN_RAY_STRATEGY``).
        placement_timeout: seconds to wait for the bundles (default 300, or
            ``GANGRUN_RAY_PLACEMENT_TIMEOUT``; never longer than the call's ``timeout``).
        forward_env: further caller variables shipped to the ranks (default:
            ``GANGRUN_RAY_FORWARD_ENV``, comma separated).

    A field left ``None`` takes its variable's value when the call's options are resolved,
    else its built-in default.
    """

    ship: bool = True
    paths: tuple[str, ...] = ()
    excludes: tuple[str, ...] = ()
    max_ship_bytes: int | None = DEFAULT_MAX_SHIP_BYTES
    pip: tuple[str, ...] = ()
    env_vars: Mapping[str, str] = field(default_factory=dict)
    runtime_env: Mapping[str, Any] | None = _setting(contract.RAY_RUNTIME_ENV, "json", None)
    strategy: str | None = _setting(contract.RAY_STRATEGY, "str", "PACK")
    placement_timeout: float | None = _setting(contract.RAY_PLACEMENT_TIMEOUT, "duration", 300.0)
    forward_env: tuple[str, ...] | None = _setting(contract.RAY_FORWARD_ENV, "names", ())

    @classmethod
    def coerce(cls, value: Any) -> RayOptions:
        """``value`` as [`RayOptions`][gangrun.options.RayOptions] (from a dict such as ``{"pip": ["x"]}``)."""
        out: RayOptions = _coerce_group(
            cls, value, "ray", ("paths", "excludes", "pip", "forward_env")
        )
        return out

    def with_builtins(self) -> RayOptions:
        """The fields still unset (``None``) at their built-in defaults."""
        out: RayOptions = _with_builtins(self)
        return out

    def validate(self) -> RayOptions:
        if not isinstance(self.ship, bool):
            raise LaunchError(f"ray.ship must be True or False, got {self.ship!r}.")
        for name in ("paths", "excludes", "pip"):
            v = getattr(self, name)
            if isinstance(v, str) or not all(isinstance(x, str) and x for x in v):
                raise LaunchError(f"ray.{name} must be a list of strings, got {v!r}.")
        m = self.max_ship_bytes
        if m is not None and (isinstance(m, bool) or not isinstance(m, numbers.Integral) or m < 1):
            raise LaunchError(f"ray.max_ship_bytes must be a positive integer or None, got {m!r}.")
        if not isinstance(self.env_vars, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.env_vars.items()
        ):
            raise LaunchError(f"ray.env_vars must be a dict of str to str, got {self.env_vars!r}.")
        if self.runtime_env is not None and not isinstance(self.runtime_env, Mapping):
            raise LaunchError(f"ray.runtime_env must be a dict, got {self.runtime_env!r}.")
        if isinstance(self.strategy, str):
            object.__setattr__(self, "strategy", self.strategy.strip().upper())
        if self.strategy is not None and self.strategy not in RAY_STRATEGIES:
            raise LaunchError(
                f"ray.strategy must be one of {RAY_STRATEGIES}, got {self.strategy!r}."
            )
        _seconds_or_none(self, "ray", "placement_timeout")
        fe = self.forward_env
        if fe is not None and (isinstance(fe, str) or not all(isinstance(x, str) for x in fe)):
            raise LaunchError(f"ray.forward_env must be a list of variable names, got {fe!r}.")
        return self


# --- end of the Ray option group


@dataclass(frozen=True)
class ForkServerOptions:
    """The warm fork server that local ranks fork from (``Options.forkserver``; a dict is
    accepted). Each field left ``None`` takes its variable's value when the call's options
    are resolved, else its built-in default.

    Attributes:
        preload: modules the server imports before forking (default ``("torch",)``, or
            ``GANGRUN_PRELOAD``: comma separated, ``none`` for nothing). Calls with other
            modules get a server of their own.
        start_timeout: seconds to wait for the server to start (default 300, or
            ``GANGRUN_FORKSERVER_START_TIMEOUT``); past it the call starts fresh
            interpreters instead.
    """

    preload: tuple[str, ...] | None = _setting(contract.PRELOAD, "modules", ("torch",))
    start_timeout: float | None = _setting(contract.FORKSERVER_START_TIMEOUT, "duration", 300.0)

    @classmethod
    def coerce(cls, value: Any) -> ForkServerOptions:
        """``value`` as [`ForkServerOptions`][gangrun.options.ForkServerOptions] (a dict of its fields)."""
        out: ForkServerOptions = _coerce_group(cls, value, "forkserver", ("preload",))
        return out

    def with_builtins(self) -> ForkServerOptions:
        """The fields still unset (``None``) at their built-in defaults."""
        out: ForkServerOptions = _with_builtins(self)
        return out

    def validate(self) -> ForkServerOptions:
        p = self.preload
        if p is not None and (isinstance(p, str) or not all(isinstance(x, str) and x for x in p)):
            raise LaunchError(f"forkserver.preload must be a list of module names, got {p!r}.")
        _seconds_or_none(self, "forkserver", "start_timeout")
        return self


@dataclass(frozen=True)
class Options:
    """Settings of a distributed function (the decorator's keyword arguments).

    Each can be defaulted outside code by ``gangrun.set_defaults(...)`` or a
    ``GANGRUN_<OPTION>`` environment variable (see `gangrun.defaults`).

    Attributes:
        gpus: ranks on this node, one GPU each; an int (how many) or a list of physical
            device indices (``[0, 3]``, as ``nvidia-smi`` numbers them). Default: every GPU.
        processes: CPU ranks (gloo), no GPU needed. Exactly one of ``gpus``/``processes``.
        gpu_type: required accelerator, e.g. ``"H100"`` (matched against the device name).
        timeout: seconds for the whole call (default 3 h); ``None`` (or 0) disables.
        mlflow: one MLflow run per call (default on).
        env: extra environment variables for every rank.
        max_restarts: relaunch the whole gang up to N times after a failure worth retrying
            (a failure certain to repeat stops at once: docs/restarts.md).
        min_ranks: with ``backend="ray"`` and ``max_restarts``: a restart after a lost node
            runs on the ranks the cluster can still place, as few as ``min_ranks`` (it waits
            for that many); a `gangrun.Checkpointer` reshards the state onto them
            (docs/long_runs.md, "Another number of GPUs"). Default: every restart has the
            call's world size.
        restart_backoff: seconds to wait before the first restart, doubled for each next one
            (default 1; 0: restart at once).
        restart_backoff_max: the longest wait between two attempts (default 60 s).
        output: ``"all"`` (every rank, prefixed), ``"rank0"`` or ``"none"``.
        max_capture_bytes: limit on the pickled function and arguments (default 1 GiB).
        grace_period: seconds between SIGTERM and SIGKILL when stopping ranks.
        log_dir: keep every rank's log under this directory.
        start_method: ``"auto"`` (fork server when usable), ``"spawn"`` or ``"forkserver"``.
        backend: ``"local"`` (this node) or ``"ray"`` (a Ray cluster).
        address: Ray cluster address (backend ``"ray"``; default ``RAY_ADDRESS``).
        ray: how a Ray call reaches its nodes: [`RayOptions`][gangrun.options.RayOptions] (shipping, pip,
            placement, ...).
        forkserver: the warm fork server local ranks fork from:
            [`ForkServerOptions`][gangrun.options.ForkServerOptions] (preloaded modules, start timeout).
        log_system_metrics: log CPU/GPU/memory metrics to the MLflow run.
        hang_timeout: the hang verdict's T (docs/reliability.md): when a rank has waited this
            many seconds in a collective that a peer neither joins nor makes progress towards
            (or joined mismatched), the call stops with `DistributedHangError` naming that
            peer. ``"auto"`` (default): max(10 s, 3x the p99 step time seen so far);
            ``None`` or 0: off.
        gpu_wait: seconds to wait for GPUs busy with another call of this user (0: fail at
            once, ``None``: no limit).
        checkpoint_dir: where the call's checkpoints live (a directory or any fsspec URL),
            for `gangrun.Checkpointer` in the function; a ``run_id=`` call reuses the
            one its run recorded (docs/long_runs.md).
        memory: with ``checkpoint_dir`` and ``max_restarts``, also snapshot the
            Checkpointer's state into shared memory at step boundaries; a restart restores
            the newest of memory and storage (default on; docs/long_runs.md).
        memory_every: snapshot every N steps (default ``None``: as often as 3% of the step
            time allows, measured as the run goes).
    """

    gpus: int | list[int] | None = None
    processes: int | None = None
    gpu_type: str | None = None
    timeout: float | None = DEFAULT_TIMEOUT
    mlflow: bool = True
    env: Mapping[str, str] = field(default_factory=dict)
    max_restarts: int = 0
    min_ranks: int | None = None
    output: Literal["all", "rank0", "none"] = "all"
    # Beyond the spec's table: knobs users of long jobs ask for.
    max_capture_bytes: int | None = DEFAULT_MAX_CAPTURE_BYTES
    grace_period: float = 5.0
    log_dir: str | None = None
    start_method: Literal["auto", "spawn", "forkserver"] = "auto"
    backend: Literal["local", "ray"] = "local"
    address: str | None = None
    ray: RayOptions = field(default_factory=RayOptions)  # a typed group: checked, completed
    forkserver: ForkServerOptions = field(default_factory=ForkServerOptions)
    # MLflow (docs/tracking.md); log_system_metrics None: on for gpus= calls, off for processes=
    log_system_metrics: bool | None = None
    experiment_name: str | None = None
    run_name: str | None = None
    run_id: str | None = None
    tags: Mapping[str, str] = field(default_factory=dict)
    hang_timeout: float | str | None = "auto"  # or "auto": from the step times seen
    # GPUs busy with another call of this user: wait up to this many seconds for them
    # (0: fail at once with LaunchError, None: wait without limit). See gangrun.host.reservation.
    gpu_wait: float | None = 0.0
    # In a Jupyter kernel: the live panel of each call (off with False or output="none").
    progress: bool = True
    # Restarts (lifecycle/policy.py): the k-th restart waits backoff * 2**(k-1), at most _max.
    restart_backoff: float = 1.0
    restart_backoff_max: float = 60.0
    # Long runs (docs/long_runs.md): where gangrun.Checkpointer saves and restores.
    checkpoint_dir: str | None = None
    memory: bool = True
    memory_every: int | None = None

    def validate(self) -> Options:
        for name in DURATIONS:  # timeout="10m": the same text as GANGRUN_TIMEOUT, --timeout
            text = getattr(self, name)
            if isinstance(text, str):
                object.__setattr__(self, name, duration_from_text(name, text))

        def _int(name: str, v: Any, low: int) -> None:
            if v is None:
                return
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise LaunchError(f"{name} must be an integer, got {v!r}.")
            if v < low:
                raise LaunchError(f"{name} must be >= {low}, got {v}.")

        if self.gpus is not None and self.processes is not None:
            raise LaunchError(
                f"Pass either gpus= (one rank per GPU) or processes= (CPU ranks), not both "
                f"(got gpus={self.gpus}, processes={self.processes})."
            )
        if isinstance(self.gpus, (list, tuple)):
            _device_list(self.gpus)
        else:
            _int("gpus", self.gpus, 1)
        _int("processes", self.processes, 1)
        _int("max_restarts", self.max_restarts, 0)
        _int("min_ranks", self.min_ranks, 1)
        _int("memory_every", self.memory_every, 1)
        if not isinstance(self.memory, bool):
            raise LaunchError(f"memory must be True or False, got {self.memory!r}.")
        for name in ("timeout", "hang_timeout"):  # ZERO_IS_NONE: 0 is no limit, as the text "0"
            v = getattr(self, name)
            if v is None or (name in AUTO and v == "auto"):
                continue
            if v == 0 and _seconds(v):
                object.__setattr__(self, name, None)
                continue
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise LaunchError(f"{name} must be a number of seconds or None, got {v!r}.")
            if not _seconds(v, above=0):
                raise LaunchError(
                    f"{name} must be a positive number of seconds (finite; None or 0: no "
                    f"limit), got {v}."
                )
        for name in ("restart_backoff", "restart_backoff_max"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not 0 <= float(v) < 1e9:
                raise LaunchError(f"{name} must be a number of seconds >= 0, got {v!r}.")
        if self.gpu_wait is not None and not _seconds(self.gpu_wait, least=0):
            raise LaunchError(
                f"gpu_wait must be a number of seconds >= 0 (finite), or None to wait without "
                f"limit, got {self.gpu_wait!r}."
            )
        if self.output not in _OUTPUT_MODES:
            raise LaunchError(f"output must be one of {_OUTPUT_MODES}, got {self.output!r}.")
        if self.start_method not in _START_METHODS:
            raise LaunchError(
                f"start_method must be one of {_START_METHODS}, got {self.start_method!r}."
            )
        object.__setattr__(self, "ray", RayOptions.coerce(self.ray))  # a dict is accepted
        object.__setattr__(self, "forkserver", ForkServerOptions.coerce(self.forkserver))
        if self.backend not in _BACKENDS:
            raise LaunchError(f"backend must be one of {_BACKENDS}, got {self.backend!r}.")
        if self.gpu_type is not None and not (
            isinstance(self.gpu_type, str) and self.gpu_type.strip()
        ):
            raise LaunchError(
                f"gpu_type must be a non-empty string like 'H100', got {self.gpu_type!r}."
            )
        if not isinstance(self.env, Mapping):
            raise LaunchError(f"env must be a dict of str to str, got {type(self.env).__name__}.")
        for k, v in self.env.items():
            if not isinstance(k, str) or not k or "=" in k or "\0" in k:
                raise LaunchError(f"env has an invalid variable name {k!r}.")
            if not isinstance(v, (str, int, float)) or "\0" in str(v):
                raise LaunchError(f"env[{k!r}] must be a string, got {v!r}.")
        # --- MLflow options (the store-dependent checks are in gangrun.tracking.plan)
        for name in ("experiment_name", "run_name", "run_id"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, str) and v.strip()):
                raise LaunchError(f"{name} must be a non-empty string or None, got {v!r}.")
        if self.tags is None:
            object.__setattr__(self, "tags", {})
        if not isinstance(self.tags, Mapping):
            raise LaunchError(f"tags must be a dict of str to str, got {self.tags!r}.")
        for k, v in self.tags.items():
            if not (isinstance(k, str) and k.strip()) or not isinstance(v, str):
                raise LaunchError(
                    f"tags must map non-empty str keys to str values; got {k!r}: {v!r} "
                    f"({type(k).__name__} -> {type(v).__name__}). Convert with str()."
                )
        if self.log_system_metrics not in (None, True, False):
            raise LaunchError(
                f"log_system_metrics must be True, False or None, got {self.log_system_metrics!r}."
            )
        if self.run_id is not None and not self.mlflow:
            raise LaunchError(
                f"run_id={self.run_id!r} resumes an MLflow run, but mlflow=False turns tracking "
                "off: drop one of them."
            )
        # --- end of the MLflow options
        if self.checkpoint_dir is not None and not (
            isinstance(self.checkpoint_dir, str) and self.checkpoint_dir.strip()
        ):
            raise LaunchError(
                f"checkpoint_dir must be a directory or fsspec URL (a non-empty string) or None, "
                f"got {self.checkpoint_dir!r}."
            )
        if self.max_capture_bytes is not None:
            _int("max_capture_bytes", self.max_capture_bytes, 1)
        if not _seconds(self.grace_period, least=0):
            raise LaunchError(
                f"grace_period must be a number of seconds >= 0 (finite), got "
                f"{self.grace_period!r}."
            )
        if not isinstance(self.mlflow, bool):
            raise LaunchError(f"mlflow must be True or False, got {self.mlflow!r}.")
        return self


def _device_list(gpus: Any) -> None:
    if not gpus:
        raise LaunchError("gpus=[] names no GPU; give device indices like gpus=[0, 3], or a count.")
    for i in gpus:
        if isinstance(i, bool) or not isinstance(i, numbers.Integral) or i < 0:
            raise LaunchError(
                f"gpus={list(gpus)!r}: device indices must be integers >= 0, got {i!r}."
            )
    if len(set(gpus)) != len(gpus):
        raise LaunchError(f"gpus={list(gpus)!r} names a device twice; list each index once.")


GROUPS = ("ray", "forkserver")  # the options that are typed groups of settings

__all__ = [
    "Options",
    "RayOptions",
    "ForkServerOptions",
    "GROUPS",
    "DEFAULT_TIMEOUT",
    "AUTO",
    "DURATIONS",
    "duration_from_text",
]
