"""The public surface: ``@distributed``, its options, and the run handle."""

from __future__ import annotations

import atexit
import dataclasses
import functools
import numbers
import shutil
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, ParamSpec, TypeVar, overload

from .errors import DistributedError, LaunchError
from .serialization import DEFAULT_MAX_CAPTURE_BYTES

P = ParamSpec("P")
R = TypeVar("R")

DEFAULT_TIMEOUT = 10800.0
_OUTPUT_MODES = ("all", "rank0", "none")
_START_METHODS = ("auto", "spawn", "forkserver")
_BACKENDS = ("local", "ray")


@dataclass(frozen=True)
class Options:
    """Settings of a distributed function (the decorator's keyword arguments)."""

    gpus: int | None = None
    processes: int | None = None
    gpu_type: str | None = None
    timeout: float | None = DEFAULT_TIMEOUT
    mlflow: bool = True
    env: Mapping[str, str] = field(default_factory=dict)
    max_restarts: int = 0
    output: Literal["all", "rank0", "none"] = "all"
    # Beyond the spec's table: knobs users of long jobs ask for.
    max_capture_bytes: int | None = DEFAULT_MAX_CAPTURE_BYTES
    grace_period: float = 5.0
    log_dir: str | None = None
    start_method: Literal["auto", "spawn", "forkserver"] = "auto"
    backend: Literal["local", "ray"] = "local"
    address: str | None = None
    log_system_metrics: bool = False
    hang_timeout: float | None = None
    # GPUs busy with another call of this user: wait up to this many seconds for them
    # (0: fail at once with LaunchError, None: wait without limit). See gangrun.reservation.
    gpu_wait: float | None = 0.0
    # In a Jupyter kernel: the live panel of each call (off with False or output="none").
    progress: bool = True

    def validate(self) -> Options:
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
        _int("gpus", self.gpus, 1)
        _int("processes", self.processes, 1)
        _int("max_restarts", self.max_restarts, 0)
        for name in ("timeout", "hang_timeout"):
            v = getattr(self, name)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise LaunchError(f"{name} must be a number of seconds or None, got {v!r}.")
            if v <= 0:
                raise LaunchError(
                    f"{name} must be a positive number of seconds (or None to disable), got {v}."
                )
        if self.gpu_wait is not None and (
            isinstance(self.gpu_wait, bool)
            or not isinstance(self.gpu_wait, numbers.Real)
            or self.gpu_wait < 0
        ):
            raise LaunchError(
                f"gpu_wait must be a number of seconds >= 0 or None, got {self.gpu_wait!r}."
            )
        if self.output not in _OUTPUT_MODES:
            raise LaunchError(f"output must be one of {_OUTPUT_MODES}, got {self.output!r}.")
        if self.start_method not in _START_METHODS:
            raise LaunchError(
                f"start_method must be one of {_START_METHODS}, got {self.start_method!r}."
            )
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
        if self.max_capture_bytes is not None:
            _int("max_capture_bytes", self.max_capture_bytes, 1)
        if self.grace_period < 0:
            raise LaunchError(f"grace_period must be >= 0, got {self.grace_period}.")
        return self


def _release_run(ref: Any, run_dir: str) -> None:
    run = ref()
    if run is not None:
        run.release()
    elif run_dir:
        shutil.rmtree(run_dir, ignore_errors=True)


class RunHandle(Generic[R]):
    """A running (or finished) call, returned by ``submit()``."""

    def __init__(self, run: Any) -> None:
        self._run = run
        # The run directory (logs) lives as long as the handle, unless log_dir= keeps them.
        # A handle dropped while its call still runs must not pull the files from under it:
        # the run then removes its directory itself when it ends.
        # The callback holds the run only weakly: run -> error -> handle would otherwise keep
        # the handle alive from the finalizer registry forever.
        self._finalizer = weakref.finalize(self, _release_run, weakref.ref(run), run.run_dir)

    @property
    def run_id(self) -> str:
        return str(self._run.run_id)

    @property
    def world_size(self) -> int:
        return int(self._run.world_size)

    @property
    def mlflow_run_id(self) -> str | None:
        t = self._run.tracker
        return None if t is None else t.run_id

    @property
    def log_dir(self) -> str:
        return str(self._run.log_dir)

    def result(self, timeout: float | None = None) -> list[R]:
        """Block until the call ends; the per-rank results in rank order.

        Raises the call's ``DistributedError`` on failure, or ``TimeoutError`` if it is still
        running after ``timeout`` seconds (the call keeps running; ``cancel()`` stops it).
        """
        if not self._run.wait(timeout):
            raise TimeoutError(f"run {self.run_id} is still running after {timeout}s")
        try:
            return self._run.outcome()  # type: ignore[no-any-return]
        except DistributedError as err:
            if err.handle is None:
                err.handle = self
            raise

    def done(self) -> bool:
        return bool(self._run.done())

    def cancel(self) -> bool:
        """Stop every rank (and their descendants). True if the call was still running."""
        return bool(self._run.cancel("cancelled"))

    def logs(self, rank: int = 0) -> str:
        """Everything rank ``rank`` wrote to stdout and stderr so far."""
        path = self._run.log_files().get(rank)
        if path is None:
            raise ValueError(f"rank must be in 0..{self.world_size - 1}, got {rank}")
        try:
            with open(path, "rb") as f:
                return f.read().decode("utf-8", "replace")
        except FileNotFoundError:
            return ""

    def _repr_html_(self) -> str:
        from .notebook.html import handle_html

        return handle_html(self)

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"<RunHandle {self.run_id} {self._run.fn_name} world_size={self.world_size} {state}>"


class DistributedFunction(Generic[P, R]):
    """A function that runs on every rank with ``.distributed()`` / ``.submit()``.

    Calling it directly still runs the plain function in this process.
    """

    def __init__(self, fn: Callable[P, R], options: Options) -> None:
        self._fn = fn
        self._options = options
        functools.update_wrapper(self, fn)  # type: ignore[arg-type]
        from .notebook.session import on_decorate

        on_decorate(options)  # in a kernel: warm the fork server for the first call

    @property
    def settings(self) -> Options:
        return self._options

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        return self._fn(*args, **kwargs)

    def submit(self, *args: P.args, **kwargs: P.kwargs) -> RunHandle[R]:
        """Start the call and return a handle at once. Launch errors are raised here."""
        from .notebook import checks, session
        from .run import Run

        checks.refuse_nested()  # inside a rank: fail there, start no inner gang
        checks.bind_arguments(self._fn, args, kwargs)  # a misspelled argument: no rank starts
        opts = self._options.validate()
        run: Any
        if opts.backend == "ray":
            from .launch.ray import RayRun

            run = RayRun(self._fn, args, kwargs, opts)
        else:
            run = Run(self._fn, args, kwargs, opts)
        session.attach(run, opts)  # in a kernel: output to this cell, the live panel
        try:
            run.start()
            return RunHandle(run)
        except BaseException:
            # e.g. Ctrl-C just as the monitor started (start() cleans up its own failures
            # before that point): nothing may keep running without a handle.
            if getattr(run, "_thread", None) is not None:
                run.cancel("interrupted", wait=60.0)
                run._remove_dir()
            raise

    def distributed(self, *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """Run on every rank and block; the per-rank return values in rank order.

        ``KeyboardInterrupt`` (Ctrl-C, "interrupt kernel") stops every rank and re-raises.
        """
        handle = None
        try:
            handle = self.submit(*args, **kwargs)
            return handle.result()
        except KeyboardInterrupt:
            if handle is not None:
                handle._run.cancel("interrupted", wait=60.0)
            raise

    def options(self, **overrides: Any) -> DistributedFunction[P, R]:
        """A copy with other settings, e.g. ``train.options(processes=4).distributed()``."""
        from .notebook.checks import unknown_options

        unknown_options(overrides, (f.name for f in dataclasses.fields(Options)))
        if "processes" in overrides and "gpus" not in overrides:
            overrides["gpus"] = None
        if "gpus" in overrides and "processes" not in overrides:
            overrides["processes"] = None
        return DistributedFunction(
            self._fn, dataclasses.replace(self._options, **overrides).validate()
        )

    def __repr__(self) -> str:
        return f"<distributed function {getattr(self._fn, '__qualname__', self._fn)!r} {self._options}>"


@overload
def distributed(fn: Callable[P, R], /) -> DistributedFunction[P, R]: ...


@overload
def distributed(
    fn: None = None,
    /,
    *,
    gpus: int | None = None,
    processes: int | None = None,
    gpu_type: str | None = None,
    timeout: float | None = DEFAULT_TIMEOUT,
    mlflow: bool = True,
    env: Mapping[str, str] | None = None,
    max_restarts: int = 0,
    output: Literal["all", "rank0", "none"] = "all",
    **more: Any,
) -> Callable[[Callable[P, R]], DistributedFunction[P, R]]: ...


def distributed(fn: Any = None, /, **kwargs: Any) -> Any:
    """Decorate a function to run on every GPU of this node (or ``processes=N`` CPU ranks).

    ``@distributed`` and ``@distributed(...)`` both work; see :class:`Options` for the
    keyword arguments. Bad settings raise :class:`gangrun.LaunchError` right here.
    """
    from .notebook.checks import unknown_options

    unknown_options(
        kwargs, (f.name for f in dataclasses.fields(Options)), "@distributed argument(s)"
    )
    if kwargs.get("env") is None:
        kwargs.pop("env", None)
    opts = Options(**kwargs).validate()

    def wrap(f: Callable[P, R]) -> DistributedFunction[P, R]:
        if not callable(f):
            raise LaunchError(f"@distributed decorates a function, got {f!r}")
        return DistributedFunction(f, opts)

    if fn is not None:
        return wrap(fn)
    return wrap


def _stop_all_at_exit() -> None:
    from . import run

    run.stop_all()


atexit.register(_stop_all_at_exit)

__all__ = ["distributed", "DistributedFunction", "RunHandle", "Options"]
