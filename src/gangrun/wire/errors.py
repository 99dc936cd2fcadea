"""Every exception gangrun raises to its callers, defined here because they cross process
boundaries (a rank's failure is pickled to the caller, a gang's through Ray) and the formats
here raise them; users import them from `gangrun.errors` (or `gangrun`), the path their
``__module__`` and pickles name."""

from __future__ import annotations

from .exitcodes import signal_name

# Messages that say a peer went away: a rank failing with one is the echo of a peer's death.
# The root-cause choice ranks such a failure behind every other (`gangrun.lifecycle.rootcause`),
# the restart policy retries it (`gangrun.lifecycle.policy`), and the live output folds such a
# traceback into one line (`gangrun.output_fold`). Regular expressions, case-insensitive.
PEER_ECHO_TEXT = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "remote worker crash",
    "remote process exited",
    "NCCL communicator was aborted",
    "ProcessGroupGloo.*(?:Timed out|closed)",
    "DistNetworkError",
    "DistStoreError",
    "recvValue failed",
    "Socket Timeout",
    "Connection refused",
)

TYPE_CHECKING = False  # not typing's: importing typing is most of `import gangrun`'s time
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from .records import RankFailure

    # what __reduce__ returns: _rebuild and its arguments (class, message, keyword arguments)
    Reduced = tuple[Callable[..., "DistributedError"], tuple[type["DistributedError"], str, dict]]

# An error's HTML form in a notebook (`DistributedError._repr_html_`). This module is a leaf:
# the notebook side, imported by every decoration and call, registers its renderer here.
_html: Callable[[DistributedError], str] | None = None


def register_html(render: Callable[[DistributedError], str] | None) -> None:
    """Render errors with ``render`` in a notebook (``None``: plain text only)."""
    global _html
    _html = render


class DistributedError(RuntimeError):
    """A distributed call failed.

    ``rank`` is the root-cause rank (``None`` when no rank is to blame, e.g. a cancel),
    ``exitcode`` its exit status (negative: killed by signal ``-exitcode``),
    ``signal`` the signal name (``"SIGKILL"``, ``"SIGSEGV"``...) when it died by one,
    ``traceback`` the rank's formatted Python traceback when it raised, and
    ``exc_type`` the qualified name of the exception it raised.
    When the rank's exception could be rebuilt in the caller it is ``__cause__``.
    ``failures`` holds every rank that failed on its own (not stopped by the teardown), keyed
    by rank, as `RankFailure` records; the message leads with the root cause.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        exitcode: int | None = None,
        traceback: str | None = None,
        exc_type: str | None = None,
        log_tail: str = "",
        run_id: str | None = None,
        failures: dict[int, RankFailure] | None = None,
    ) -> None:
        super().__init__(message)
        self.failures: dict[int, RankFailure] = dict(failures or {})
        self.rank = rank
        self.exitcode = exitcode
        self.traceback = traceback
        self.exc_type = exc_type
        self.log_tail = log_tail
        self.run_id = run_id

    handle: object | None = None  # the RunHandle, kept alive so its logs stay readable

    def logs(self, rank: int | None = None) -> str:
        """The full log of ``rank`` (default: the root-cause rank) of the failed call."""
        if self.handle is None:
            return self.log_tail or ""
        r = self.rank if rank is None else rank
        return self.handle.logs(0 if r is None else r)  # type: ignore[attr-defined]

    @property
    def signal(self) -> str | None:
        return signal_name(self.exitcode)

    def _repr_html_(self) -> str | None:
        render = _html  # None: IPython shows the plain text
        return None if render is None else render(self)

    def __reduce__(self) -> Reduced:  # keep attributes across pickling
        return (
            _rebuild,
            (
                type(self),
                str(self),
                {
                    "rank": self.rank,
                    "exitcode": self.exitcode,
                    "traceback": self.traceback,
                    "exc_type": self.exc_type,
                    "log_tail": self.log_tail,
                    "run_id": self.run_id,
                    "failures": self.failures,
                },
            ),
        )


def _rebuild(cls: type[DistributedError], message: str, kwargs: dict[str, Any]) -> DistributedError:
    return cls(message, **kwargs)


class LaunchError(DistributedError):
    """Nothing was started: bad arguments, serialization, size, accelerator count or type."""


class DistributedTimeoutError(DistributedError, TimeoutError):
    """The call ran past its ``timeout``; every rank was stopped.

    ``where`` says where each rank was at that moment (`gangrun.wire.hangs.RankPlace`: its
    line in user code, the collective it waited in), as the message's "Where each rank was"
    section does; empty when it could not be read (an interactive gang, a Ray node).
    """

    def __init__(self, message: str, *, where: tuple[Any, ...] = (), **kwargs: object) -> None:
        super().__init__(message, **kwargs)  # type: ignore[arg-type]
        self.where = tuple(where)

    def __reduce__(self) -> Reduced:
        fn, (cls, msg, kw) = super().__reduce__()
        return fn, (cls, msg, dict(kw, where=self.where))


_CANCELLED_DOC = """The call was cancelled (``handle.cancel()`` or an interrupt); every rank was
    stopped. Also a ``concurrent.futures.CancelledError``, as a cancelled future's error is."""

if TYPE_CHECKING:
    from concurrent.futures import CancelledError

    class DistributedCancelledError(DistributedError, CancelledError):
        """The call was cancelled (``handle.cancel()`` or an interrupt); every rank was
        stopped. Also a ``concurrent.futures.CancelledError``, as a cancelled future's error is."""


def __getattr__(name: str) -> Any:
    """`DistributedCancelledError`, made on first use: its base
    ``concurrent.futures.CancelledError`` imports ``logging`` and ``threading``, which would
    double the time of ``import gangrun``. Pickling and ``from gangrun.errors import ...``
    reach it here."""
    if name != "DistributedCancelledError":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from concurrent.futures import CancelledError

    made = type(
        name,
        (DistributedError, CancelledError),
        {"__doc__": _CANCELLED_DOC, "__module__": PUBLIC, "__qualname__": name},
    )
    return globals().setdefault(name, made)  # one class, whichever thread made it first


class DistributedPreemptedError(DistributedError):
    """The call was preempted (SIGTERM to the caller or to a rank, or
    ``handle.cancel(checkpoint=True)``): every rank saved a checkpoint, then stopped.

    ``checkpoint`` is the checkpoint written, ``step`` its step, ``mlflow_run_id`` the run to
    continue, ``resume`` the one line that resumes the call (also in the message).
    """

    def __init__(
        self,
        message: str,
        *,
        checkpoint: str | None = None,
        step: int | None = None,
        mlflow_run_id: str | None = None,
        resume: str | None = None,
        **kwargs: object,
    ) -> None:
        super().__init__(message, **kwargs)  # type: ignore[arg-type]
        self.checkpoint, self.step = checkpoint, step
        self.mlflow_run_id, self.resume = mlflow_run_id, resume

    def __reduce__(self) -> Reduced:
        fn, (cls, msg, kw) = super().__reduce__()
        more = {"checkpoint": self.checkpoint, "step": self.step, "resume": self.resume}
        return fn, (cls, msg, dict(kw, mlflow_run_id=self.mlflow_run_id, **more))


class DistributedHangError(DistributedError, TimeoutError):
    """The call hung: ranks waited ``hang_timeout`` seconds in a collective that a peer did not
    enter while making no progress (or entered mismatched); every rank was stopped.

    ``ranks`` are the holding ranks (``rank`` is the first of them), ``hang`` the whole verdict
    (`gangrun.wire.hangs.Hang`: the collective waited in, where each rank was), ``stacks``
    maps each live rank to its Python stacks (all threads) at that moment.
    """

    def __init__(
        self,
        message: str,
        *,
        ranks: list[int] | None = None,
        stacks: dict[int, str] | None = None,
        hang: Any = None,
        **kwargs: object,
    ) -> None:
        super().__init__(message, **kwargs)  # type: ignore[arg-type]
        self.ranks = list(ranks or [])
        self.stacks = dict(stacks or {})
        self.hang = hang

    def __reduce__(self) -> Reduced:
        fn, (cls, msg, kw) = super().__reduce__()
        return fn, (cls, msg, dict(kw, ranks=self.ranks, stacks=self.stacks, hang=self.hang))


class GangError(DistributedError):
    """An interactive `gangrun.Gang` failed, like a call does: ``rank`` the first failed
    rank, ``failures`` every rank's `RankFailure`.

    ``ranks`` are the ranks whose execution raised and ``results`` every rank's value in rank
    order (``None`` where it raised): such a gang stays usable. ``rank_died`` says a rank
    died instead: its peers were stopped and the gang is broken (``g.restart()``), or it was
    healed (``max_restarts``); ``before_start``: it died before this execution began.
    """

    def __init__(
        self,
        message: str,
        *,
        ranks: list[int] | None = None,
        results: list[object] | None = None,
        rank_died: bool = False,
        before_start: bool = False,
        **kwargs: object,
    ) -> None:
        super().__init__(message, **kwargs)  # type: ignore[arg-type]
        self.ranks = list(ranks or [])
        self.results = results if results is not None else []
        self.rank_died, self.before_start = rank_died, before_start

    def __reduce__(self) -> Reduced:
        fn, (cls, msg, kw) = super().__reduce__()
        more = {"ranks": self.ranks, "results": self.results, "rank_died": self.rank_died}
        return fn, (cls, msg, dict(kw, before_start=self.before_start, **more))


class PrivateImportError(ImportError):
    """A private name gangrun relies on is missing from the installed library version (torch,
    Ray): the message names what is missing, the version installed and the versions gangrun
    supports. An ``ImportError``, raised where the feature is used, not at ``import gangrun``."""


PUBLIC = "gangrun.errors"  # where users import them from: what tracebacks and pickles name
for _cls in (
    DistributedError,
    LaunchError,
    DistributedTimeoutError,
    DistributedHangError,
    DistributedPreemptedError,
    GangError,
    PrivateImportError,
):
    _cls.__module__ = PUBLIC

__all__ = [
    "DistributedError",
    "LaunchError",
    "DistributedTimeoutError",
    "DistributedCancelledError",
    "DistributedHangError",
    "DistributedPreemptedError",
    "GangError",
    "PrivateImportError",
    "signal_name",
]
