"""The public surface: ``@distributed``, its options, and the run handle."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import os
import shutil
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, TypeVar, overload

from . import defaults as _defaults
from .errors import DistributedError, LaunchError
from .options import Options

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from .lifecycle.observers import Wiring
    from .lifecycle.supervisor import Supervisor
    from .lifecycle.watch import Progress
    from .option_kwargs import OptionKwargs

log = logging.getLogger("gangrun.api")
P = ParamSpec("P")
R = TypeVar("R")


def _release_run(ref: Callable[[], Supervisor | None], run_dir: str, owner: int) -> None:
    if os.getpid() != owner:
        return  # a forked child exiting: the call and its files are its parent's
    run = ref()
    if run is not None:
        run.release()
    elif run_dir:
        shutil.rmtree(run_dir, ignore_errors=True)


class _Callbacks:
    """The handle's done callbacks until the call's end runs them (once, then closed: a
    callback added later runs at once, in the adding thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fns: list[Callable[[Any], object]] = []
        self._closed = False

    def add(self, fn: Callable[[Any], object]) -> bool:
        """Keep ``fn`` for the end; False once the end has taken them (run it now)."""
        with self._lock:
            if self._closed:
                return False
            self._fns.append(fn)
            return True

    def close(self) -> list[Callable[[Any], object]]:
        """The callbacks to run now; any added later runs at once."""
        with self._lock:
            self._closed = True
            fns, self._fns = self._fns, []
            return fns


def _call_back(fn: Callable[[Any], object], handle: RunHandle[Any]) -> None:
    try:
        fn(handle)
    except Exception:
        log.exception("a done callback of run %s failed", handle.run_id)


class _Completion:
    """The handle's ``concurrent.futures`` half, run by the call's done event
    (`gangrun.lifecycle.done`). It holds the handle only weakly, and the event drops it once
    run: a handle nobody holds is collected (its run directory removed) at once, whatever
    thread ended its call. It never stores the call's error."""

    def __init__(self, handle: RunHandle[Any]) -> None:
        self._ref = weakref.ref(handle)
        self._callbacks = handle._callbacks  # the callbacks, not the handle

    def settle(self) -> None:
        handle = self._ref()
        if handle is not None:
            handle._settle()

    def notify(self) -> None:
        fns = self._callbacks.close()
        if not fns:
            return  # no callback: not even a moment's strong reference to the handle
        handle = self._ref()
        if handle is not None:
            for fn in fns:
                _call_back(fn, handle)


class RunHandle(concurrent.futures.Future[list[R]]):
    """A running (or finished) call, returned by ``submit()``.

    It is a ``concurrent.futures.Future`` of the per-rank results: ``done()``,
    ``running()``, ``cancelled()``, ``exception()``, ``add_done_callback()``, and
    ``concurrent.futures.wait`` / ``as_completed`` work on handles. ``result()`` raises
    the call's ``DistributedError`` (a cancelled call: ``DistributedCancelledError``, which
    ``exception()`` returns, and which is also a ``concurrent.futures.CancelledError``);
    ``cancel()`` stops every rank.

    The call completes the future through ``Future``'s public methods only (the executor's
    protocol), so no Python release can change it under gangrun: the future stays pending
    while the call runs (``running()`` says whether the call runs), and the call's end sets
    its result, its error, or cancels it.
    """

    def __init__(self, run: Supervisor) -> None:
        super().__init__()
        self._callbacks = _Callbacks()
        self._run = run
        # The run directory (logs) lives as long as the handle, unless log_dir= keeps them.
        # A handle dropped while its call still runs must not pull the files from under it:
        # the run then removes its directory itself when it ends.
        # The callback holds the run only weakly: run -> error -> handle would otherwise keep
        # the handle alive from the finalizer registry forever.
        self._finalizer = weakref.finalize(
            self, _release_run, weakref.ref(run), run.run_dir, run.owner_pid
        )
        run.on_done(_Completion(self))  # settles at once if the call has already ended

    @property
    def run_id(self) -> str:
        return self._run.run_id

    @property
    def world_size(self) -> int:
        return self._run.world_size

    @property
    def mlflow_run_id(self) -> str | None:
        return self._run.mlflow_run_id

    @property
    def log_dir(self) -> str:
        return self._run.log_dir

    @property
    def fn_name(self) -> str:
        return self._run.fn_name

    @property
    def supervisor(self) -> Supervisor:
        """The call's `gangrun.lifecycle.Supervisor`, for gangrun's own layers (the CLI, the
        interactive gang); not part of the user contract."""
        return self._run

    def result(self, timeout: float | None = None) -> list[R]:
        """Block until the call ends; the per-rank results in rank order.

        Raises the call's ``DistributedError`` on failure, or ``TimeoutError`` if it is still
        running after ``timeout`` seconds (the call keeps running; ``cancel()`` stops it).
        """
        self._wait(timeout)
        try:
            return self._run.result()
        except DistributedError as err:
            if err.handle is None:
                err.handle = self
            raise

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Block until the call ends; its error (``None`` if it succeeded). A cancelled call
        returns its ``DistributedCancelledError`` (a plain ``Future`` raises instead).
        ``TimeoutError`` if it is still running after ``timeout`` seconds."""
        self._wait(timeout)
        err = self._run.outcome.error
        if isinstance(err, DistributedError) and err.handle is None:
            err.handle = self
        return err

    def _wait(self, timeout: float | None) -> None:
        if not self._run.wait(timeout):
            raise TimeoutError(f"run {self.run_id} is still running after {timeout}s")

    def running(self) -> bool:
        """True while the call runs (a submitted call runs at once)."""
        return not self.done()

    def cancel(
        self, checkpoint: bool = False, wait: bool | float = False, *, reason: str = "cancelled"
    ) -> bool:
        """Stop every rank (and their descendants); True if the call was still running.

        It returns at once, as ``Future.cancel()`` does, while the call tears its ranks down:
        ``result()`` (or ``wait=True``) waits for that, and ``cancelled()`` and ``done()`` turn
        True when the call has ended cancelled. ``wait`` (seconds, or ``True``: until the
        call has ended) waits here. ``reason`` is what the `DistributedCancelledError` says
        the call was (``"cancelled"``, ``"interrupted"``).

        ``checkpoint=True`` (a call with ``checkpoint_dir``): the ranks first finish their
        step and save a checkpoint, within ``grace_period``; ``result()`` then raises
        [`DistributedPreemptedError`][gangrun.DistributedPreemptedError] with the line that
        resumes the call."""
        timeout = None if wait is True else float(wait)
        return self._run.cancel(reason, wait=timeout, checkpoint=checkpoint)

    def add_done_callback(self, fn: Callable[[concurrent.futures.Future[list[R]]], object]) -> None:
        """``fn(handle)`` once the call has ended, in the thread that ended it (at once, here,
        if it has already ended). A callback that raises is logged."""
        if not self._callbacks.add(fn):
            _call_back(fn, self)

    # ------------------------------------------------ concurrent.futures, completed by the call
    def _settle(self) -> None:
        """The call has ended (its done event, before it is set): the future completed through
        its public methods, which tell the waiters of ``concurrent.futures.wait`` /
        ``as_completed`` (the callbacks are the handle's own, run after the event)."""
        from .lifecycle.state import State

        if self.done():
            return
        outcome = self._run.outcome
        try:
            if outcome.state is State.CANCELLED:
                super().cancel()  # pending: cancelled ...
                super().set_running_or_notify_cancel()  # ... and the waiters told
            elif outcome.error is None:
                super().set_result(outcome.results or [])
            else:
                super().set_exception(outcome.error)
        except concurrent.futures.InvalidStateError:
            pass  # already completed

    def set_running_or_notify_cancel(self) -> bool:
        raise RuntimeError("a RunHandle is run and completed by its call, not by an executor")

    def set_result(self, result: list[R]) -> None:
        raise RuntimeError("a RunHandle is completed by its call")

    def set_exception(self, exception: BaseException | None) -> None:
        raise RuntimeError("a RunHandle is completed by its call")

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

    def progress(self) -> Progress:
        """What the ranks' `gangrun.report_step` calls say now: the step (the slowest
        rank's), the total, steps per second, the ETA, slow and silent ranks. ``.reported``
        is False while no rank reports."""
        from .lifecycle.watch import Progress

        watch = self._run.watch
        return Progress() if watch is None else watch.progress()

    def stacks(self, timeout: float = 5.0) -> dict[int, str]:
        """Every live rank's Python stacks (all threads), rank -> text, while the call keeps
        running (``faulthandler`` on ``SIGUSR1``, as the hang guard uses). A rank still
        starting is left out; one that did not answer within ``timeout`` maps to ``""``."""
        watch = self._run.watch
        return {} if watch is None else watch.stacks(timeout)

    def _repr_html_(self) -> str:
        from .notebook.html import handle_html

        return handle_html(self)

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"<RunHandle {self.run_id} {self.fn_name} world_size={self.world_size} {state}>"


class DistributedFunction(Generic[P, R]):
    """A function that runs on every rank with ``.distributed()`` / ``.submit()``.

    Calling it directly still runs the plain function in this process, as a world of one
    (``RANK=0``, ``WORLD_SIZE=1``, ... for the call's duration).
    """

    def __init__(
        self,
        fn: Callable[P, R],
        options: Options | None = None,
        *,
        explicit: Mapping[str, Any] | None = None,
    ) -> None:
        self._fn = fn
        # The options given explicitly; everything else comes from set_defaults(), the
        # GANGRUN_<OPTION> environment or the built-in defaults, resolved at each call.
        # A complete Options object counts as given in full.
        if options is not None:
            explicit = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
        self._explicit: dict[str, Any] = dict(explicit or {})
        functools.update_wrapper(self, fn)
        from .notebook.session import on_decorate

        try:
            on_decorate(self._options)  # in a kernel: warm the fork server for the first call
        except LaunchError:  # a bad GANGRUN_* variable: reported when the function is called
            pass

    @property
    def _options(self) -> Options:
        """The options in force now (explicit > set_defaults > environment > built-in)."""
        return _defaults.resolve(self._explicit)

    @property
    def settings(self) -> Options:
        return self._options

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        """Run the plain function in this process, as rank 0 of a world of one: the torchrun
        variables are set for the call's duration, so ``init_process_group`` works, and a
        process group it leaves initialised is destroyed when it returns (`gangrun.plain`)."""
        from .plain import world_of_one

        with world_of_one():
            return self._fn(*args, **kwargs)

    def submit(self, *args: P.args, **kwargs: P.kwargs) -> RunHandle[R]:
        """Start the call and return a handle at once. Launch errors are raised here."""
        return submit_wired(self, args, kwargs)

    def distributed(self, *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """Run on every rank and block; the per-rank return values in rank order.

        ``KeyboardInterrupt`` (Ctrl-C, "interrupt kernel") stops every rank and raises a
        ``KeyboardInterrupt`` that says so ("stopped 2 ranks of train; nothing left running").
        """
        handle = None
        try:
            handle = self.submit(*args, **kwargs)
            return handle.result()
        except KeyboardInterrupt:
            if handle is None:
                raise
            was_running = handle.cancel(wait=60.0, reason="interrupted")
        # outside the handler: the interrupt's traceback through the waits is not shown
        raise KeyboardInterrupt(_stopped(handle, was_running))

    def options(self, **overrides: Unpack[OptionKwargs]) -> DistributedFunction[P, R]:
        """A copy with other settings, e.g. ``train.options(processes=4).distributed()``."""
        _defaults.check_names(overrides, "option")
        explicit = dict(self._explicit)
        if "processes" in overrides and "gpus" not in overrides:
            explicit.pop("gpus", None)
        if "gpus" in overrides and "processes" not in overrides:
            explicit.pop("processes", None)
        explicit.update(overrides)
        if explicit.get("env", {}) is None:
            explicit.pop("env")
        Options(**explicit).validate()
        return DistributedFunction(self._fn, explicit=explicit)

    def __repr__(self) -> str:
        name = getattr(self._fn, "__qualname__", self._fn)
        try:
            shown: Any = self._options
        except LaunchError:  # e.g. a bad GANGRUN_* variable: show what was given
            shown = self._explicit
        return f"<distributed function {name!r} {shown}>"


@overload
def distributed(fn: Callable[P, R], /) -> DistributedFunction[P, R]: ...


@overload
def distributed(
    fn: None = None, /, **options: Unpack[OptionKwargs]
) -> Callable[[Callable[P, R]], DistributedFunction[P, R]]: ...


def distributed(fn: Any = None, /, **options: Unpack[OptionKwargs]) -> Any:
    """Decorate a function to run on every GPU of this node (or ``processes=N`` CPU ranks).

    ``@distributed`` and ``@distributed(...)`` both work; see [`Options`][gangrun.api.Options] for the
    keyword arguments. Bad settings raise [`gangrun.LaunchError`][gangrun.errors.LaunchError] right here. Options
    not given here come, at each call, from [`gangrun.set_defaults`][gangrun.defaults.set_defaults], then the
    ``GANGRUN_<OPTION>`` environment variables, then the built-in defaults.
    """
    kwargs: dict[str, Any] = dict(options)
    _defaults.check_names(kwargs, "@distributed argument")
    if kwargs.get("env", {}) is None:
        kwargs.pop("env", None)
    Options(**kwargs).validate()

    def wrap(f: Callable[P, R]) -> DistributedFunction[P, R]:
        if not callable(f):
            raise LaunchError(f"@distributed decorates a function, got {f!r}")
        return DistributedFunction(f, explicit=kwargs)

    if fn is not None:
        return wrap(fn)
    return wrap


def _stopped(handle: RunHandle[Any], was_running: bool) -> str:
    """The one line an interrupted call ends with."""
    n, name = handle.world_size, handle.fn_name
    ranks = f"{n} rank{'' if n == 1 else 's'} of {name}"
    if handle.supervisor.done():
        if not was_running:
            return f"{name} had already ended; nothing left running"
        return f"stopped {ranks}; nothing left running"
    return (
        f"stopping {ranks} is taking longer than 60 s (call {handle.run_id}); `gangrun ps` "
        f"lists it and `gangrun stop {handle.run_id}` stops it"
    )


def submit_wired(
    fn: DistributedFunction[P, R],
    args: tuple,
    kwargs: dict[str, Any],
    wiring: Wiring | None = None,
) -> RunHandle[R]:
    """``fn.submit(*args, **kwargs)``, wired by its maker: ``wiring`` (``gangrun run``: the
    streams that keep its status line clear, and its kind), or ``None``: in a kernel, the
    notebook's (this cell's output, the panel), else nothing."""
    from . import _log, checks
    from .lifecycle import Supervisor
    from .notebook import session

    _log.configure()  # GANGRUN_LOG_LEVEL, once per process
    checks.refuse_nested()  # inside a rank: fail there, start no inner gang
    checks.bind_arguments(fn._fn, args, kwargs)  # a misspelled argument: no rank starts
    opts, sources = _defaults.resolve_with_sources(fn._explicit)
    opts = opts.validate()
    # planned here (bad settings: LaunchError)
    wired = session.wiring(opts) if wiring is None else wiring
    try:
        run = Supervisor(fn._fn, args, kwargs, opts, **wired)
    except LaunchError as exc:  # an option refused: say where it came from
        _defaults.name_sources(exc, opts, sources)
        raise
    try:
        run.start()
        return RunHandle(run)
    except BaseException as exc:
        if isinstance(exc, LaunchError):
            _defaults.name_sources(exc, opts, sources)
        # e.g. Ctrl-C just as the monitor started (start() cleans up its own failures
        # before that point): nothing may keep running without a handle.
        if run.started:
            run.cancel("interrupted", wait=60.0)
            run.remove_dir()
        raise


__all__ = ["distributed", "DistributedFunction", "RunHandle", "Options"]
