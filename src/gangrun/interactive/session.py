"""The caller's side of an interactive gang: `Gang`.

A gang is one ordinary call of `gangrun.rank.interactive.gang` with ``timeout=None``,
started through the public ``distributed(...).submit(...)``: launch (on this node, or on a Ray
cluster with ``backend="ray"``: placed as ``.distributed()`` places ranks), output streaming
into the caller's ``sys.stdout`` (the running cell, in a notebook), the liveness pipe (the
caller's death kills the ranks; on Ray, the driver's death takes the actors and their ranks),
teardown, root cause and the MLflow run all come from there. Each rank connects back
(`channel`: AF_UNIX on one node, TCP on a cluster), proves it knows the gang's random
token, and then serves commands (`protocol`); executions are `exchange`'s.

Self-healing: with ``max_restarts=N`` a rank that dies makes the gang restart every rank (at
most N times), re-run ``setup`` (which rebuilds the state later executions rely on, e.g. a
checkpoint restore) and say so in the cell; the next execution runs on the healed gang.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import os
import secrets
import socket
import sys
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .. import settings
from ..api import RunHandle, distributed
from ..errors import DistributedError, DistributedHangError, GangError, LaunchError
from ..lifecycle import calls
from ..options import DEFAULT_TIMEOUT, Options
from ..rank import interactive_protocol as protocol
from ..rank.interactive import gang
from ..wire import contract, serialization
from .channel import Listener, release
from .exchange import Exchanges
from .outcome import PerRank, wrapped

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ..option_kwargs import OptionKwargs

log = logging.getLogger("gangrun.interactive")

_cells = itertools.count(1)
_live: weakref.WeakSet[Gang] = weakref.WeakSet()
_last: weakref.ReferenceType[Gang] | None = None


def last_gang() -> Gang | None:
    """The gang created last in this process (``%%distributed`` without a name uses it)."""
    return None if _last is None else _last()


def _seconds(name: str, value: float | str) -> float:
    """``Gang(start_timeout="5m")``: a duration as every channel writes it (`gangrun.durations`)."""
    from ..durations import parse_seconds

    try:
        seconds = parse_seconds(value) if isinstance(value, str) else float(value)
    except (TypeError, ValueError) as exc:
        raise LaunchError(f"Gang({name}={value!r}): {exc}.") from None
    if not math.isfinite(seconds):  # NaN would pass every bound as no limit
        raise LaunchError(f"Gang({name}={value!r}): give a number of seconds (finite).")
    return seconds


def _tcp_host(address: str | None) -> tuple[str, str]:
    """Where the channel listens, and the address the ranks are given: this machine's
    address as Ray sees it, or ``GANGRUN_GANG_HOST`` (then on every interface: the address
    the nodes use may be one this machine does not own, e.g. behind a VPN's NAT)."""
    from ..launch.ray.placement import connect

    host = settings.read(contract.GANG_HOST)
    if host.source != "built-in" and host.value.strip() != "auto":
        advertised = host.value.strip()
        return ("::" if ":" in advertised else "0.0.0.0"), advertised
    ray = connect(address)
    ip = str(ray.util.get_node_ip_address())
    return ip, ip


class Gang(Exchanges):
    """Ranks that stay alive across executions, each with a persistent namespace.

    Takes the options of ``@distributed`` (``processes=``/``gpus=``, ``gpu_type``, ``env``,
    ``mlflow``, ``output``, ``backend="ray"`` with ``address=``, ...); ``timeout`` is per
    execution, ``hang_timeout`` stops an execution whose ranks show no progress (output,
    heartbeat) for that long and prints their stacks. ``max_restarts=N`` heals the gang when
    a rank dies (every rank restarted, ``setup`` re-run), at most N times. ``setup`` is a
    function run on every rank after each start (``gangrun.rank_state()`` inside).
    ``interrupt_grace`` is how long interrupted or timed-out ranks get to come back before
    they are killed; ``start_timeout`` bounds the ranks' start.

    >>> g = Gang(processes=2)
    >>> g.execute("import os; r = int(os.environ['RANK'])")
    >>> g.execute("r * 10")
    [0, 10]
    """

    def __init__(
        self,
        *,
        interrupt_grace: float | str = 1.5,
        start_timeout: float | str = 300.0,
        setup: Callable[[], Any] | None = None,
        **options: Unpack[OptionKwargs],
    ) -> None:
        global _last
        if setup is not None and not callable(setup):
            raise LaunchError(f"Gang(setup=...) takes a function, got {setup!r}")
        given: dict[str, Any] = {  # timeout="10m" as GANGRUN_TIMEOUT=10m: seconds from here on
            "timeout": options.pop("timeout", DEFAULT_TIMEOUT),
            "hang_timeout": options.pop("hang_timeout", "auto"),
            "max_restarts": int(options.pop("max_restarts", 0) or 0),
        }
        checked = Options(**given).validate()
        self.max_restarts = int(checked.max_restarts)
        self.hang_timeout: float | str | None = checked.hang_timeout
        self.timeout: float | None = checked.timeout
        options["timeout"] = None  # the gang lives across cells: each execution has its own
        self._fn = distributed(**options)(gang)
        self.options: Options = dataclasses.replace(
            self._fn.settings,
            timeout=self.timeout,
            hang_timeout=self.hang_timeout,
            max_restarts=self.max_restarts,
        )
        self.setup = setup
        self.restarts = 0
        self.interrupt_grace = _seconds("interrupt_grace", interrupt_grace)
        self.start_timeout = _seconds("start_timeout", start_timeout)
        self._lock = threading.Lock()
        self._handle: RunHandle[None] | None = None
        self._socks: dict[int, socket.socket] = {}  # rank -> its connection
        self._pids: dict[int, int] = {}
        self._dir = ""
        self._closed = True
        self._broken: str | None = None
        self._extra: dict[int, int] = {}
        self._finalizer: weakref.finalize | None = None
        self._start()
        _live.add(self)
        _last = weakref.ref(self)

    # ------------------------------------------------------------------ lifecycle
    @property
    def world_size(self) -> int:
        return len(self._socks) if self._handle is None else self._handle.world_size

    @property
    def handle(self) -> RunHandle[None] | None:
        """The gang's call: ``.mlflow_run_id``, ``.logs(rank)``, ``.log_dir``."""
        return self._handle

    @property
    def pids(self) -> dict[int, int]:
        """Each rank's pid (on its node)."""
        return dict(self._pids)

    def _start(self) -> None:
        ray = self.options.backend == "ray"
        token = secrets.token_hex(16)
        listener = Listener(_tcp_host(self.options.address) if ray else None, token)
        self._dir = listener.dir
        try:
            self._handle = self._fn.submit(listener.address, token)
            self._socks, self._pids = listener.accept(self._handle, self.start_timeout)
        except BaseException:
            release({}, self._dir)
            if self._handle is not None:
                self._handle.cancel(wait=30.0)
            raise
        finally:
            listener.close()
        self._extra = {r: 0 for r in self._socks}
        self._closed = False
        self._broken = None
        self._finalizer = weakref.finalize(self, release, self._socks, self._dir)
        if self.setup is not None:
            self._run_setup()

    def _run_setup(self) -> None:
        __tracebackhide__ = True
        assert self.setup is not None
        try:
            self._exchange(protocol.Run(self._payload(self.setup, (), {})), "setup()")
        except DistributedError as err:
            msg = f"the gang's setup() failed, so the gang was not made usable: {err}"
            raise wrapped(msg, err) from err

    def close(self, timeout: float = 30.0) -> None:
        """End the gang: every rank leaves, the MLflow run ends FINISHED. Idempotent."""
        with self._lock:
            self._close(timeout)

    def _close(self, timeout: float = 30.0) -> None:
        if self._closed:
            return
        self._closed = True
        handle = self._handle
        for s in self._socks.values():
            try:
                protocol.send(s, protocol.Close())
            except OSError:
                log.debug("gang: rank connection already gone at close", exc_info=True)
        release(self._socks, self._dir)
        if handle is not None and not self._broken:
            try:
                handle.result(timeout=timeout)
            except TimeoutError:
                log.warning("gang: ranks did not leave within %ss; stopping them", timeout)
                handle.cancel(wait=30.0)
            except DistributedError as err:
                log.warning("gang: the ranks failed while closing: %s", err)
        _live.discard(self)

    def restart(self) -> None:
        """Fresh ranks with the same options (every rank's state is lost; ``setup`` re-runs)."""
        with self._lock:
            self._close()
            self._pids = {}
            self._start_unlocked()
            _live.add(self)

    def _start_unlocked(self) -> None:
        # _start runs setup through _exchange, which takes the lock: hand it over
        self._lock.release()
        try:
            self._start()
        finally:
            self._lock.acquire()

    def __enter__(self) -> Gang:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("broken" if self._broken else "running")
        where = " on Ray" if self.options.backend == "ray" else ""
        return f"<gangrun.Gang world_size={self.world_size}{where} {state}>"

    # ------------------------------------------------------------------ executions
    def execute(self, code: str) -> list[Any]:
        """Run ``code`` on every rank in its persistent namespace; the value of its last
        expression per rank, in rank order (``None`` where it ends in a statement)."""
        __tracebackhide__ = True  # IPython: show the ranks' error, not this frame
        if not isinstance(code, str):
            raise TypeError(f"execute() takes the code as a string, got {type(code).__name__}")
        cell = next(_cells)
        protocol.compile_cell(code, protocol.cell_filename(cell))  # SyntaxError here, first
        return self._healing(protocol.Exec(cell, code), "the execution")

    def run(self, fn: Any, *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` on every warm rank; per-rank results in rank order.
        Inside, `gangrun.rank_state` is the namespace that `execute` uses."""
        __tracebackhide__ = True
        if not callable(fn):
            raise LaunchError(f"Gang.run takes a function, got {fn!r}")
        name = getattr(fn, "__qualname__", repr(fn))
        return self._healing(protocol.Run(self._payload(fn, args, kwargs)), f"{name}()")

    def _payload(self, fn: Any, args: tuple, kwargs: dict) -> bytes:
        limit = self.options.max_capture_bytes
        try:
            payload = serialization.dumps((fn, args, kwargs))
        except Exception as exc:
            raise serialization.unpicklable_error(fn, args, kwargs, exc) from exc
        if limit is not None and len(payload) > limit:
            raise serialization.too_large_error(fn, args, kwargs, limit)
        return payload

    def _healing(self, msg: protocol.Command, what: str) -> PerRank:
        """One execution; when a rank died and ``max_restarts`` allows, heal the gang (and,
        if the rank died before this execution began, run it on the healed gang)."""
        __tracebackhide__ = True
        try:
            return self._exchange(msg, what)
        except DistributedError as err:
            if not self._heal(err):
                raise
            if isinstance(err, GangError) and err.before_start:
                return self._exchange(msg, what)
            text = (
                f"{err}\n\nThe gang healed itself (restart {self.restarts} of "
                f"{self.max_restarts}: every rank restarted"
                f"{', setup() re-ran' if self.setup else ''}); this execution was lost, the "
                "next one runs on the fresh ranks."
            )
            if isinstance(err, DistributedHangError):  # ranks stuck in a collective were killed
                raise DistributedHangError(
                    text, rank=err.rank, run_id=err.run_id, ranks=err.ranks, stacks=err.stacks,
                    hang=err.hang,
                ) from err  # fmt: skip
            raise wrapped(text, err) from err

    def _heal(self, err: DistributedError) -> bool:
        if (
            not self._broken
            or self.restarts >= self.max_restarts
            or not (
                isinstance(err, GangError)
                and err.rank_died
                or isinstance(err, DistributedHangError)
            )
        ):
            return False
        self.restarts += 1
        old = None if self._handle is None else self._handle.mlflow_run_id
        if old and self.options.mlflow:  # the healed gang continues the same MLflow run
            self._fn = self._fn.options(run_id=old)
        print(
            f"gangrun: {self._broken}; restarting every rank of the gang (restart "
            f"{self.restarts} of {self.max_restarts})"
            + (" and re-running setup()" if self.setup else "")
            + ".",
            file=sys.stderr,
            flush=True,
        )
        with self._lock:
            self._pids = {}
            self._start_unlocked()
            _live.add(self)
        return True

    def _nodes_elsewhere(self) -> dict[int, str]:
        """The ranks on another node than this caller's, and their node (Ray; else ``{}``)."""
        gang = None if self._handle is None else self._handle.supervisor.gang
        return gang.nodes_elsewhere() if gang is not None else {}

    def _try_lock(self) -> bool:
        return self._lock.acquire(blocking=False)

    def _unlock(self) -> None:
        self._lock.release()

    def _rank_pids(self) -> dict[int, int]:
        return dict(self._pids)

    def _signal(self, rank: int, sig: int) -> None:
        """Signal one rank (on its node: through its actor on Ray)."""
        handle = self._handle
        if self.options.backend == "ray":
            attempt = None if handle is None else handle.supervisor.gang
            if attempt is not None:
                attempt.signal_rank(rank, sig)
            return
        try:
            os.kill(self._pids[rank], sig)
        except ProcessLookupError:
            log.debug("gang: rank %d already gone when signalled", rank)

    def _check_usable(self) -> RunHandle[None]:
        if self._broken:
            raise DistributedError(
                f"this gang is broken ({self._broken}); its ranks were stopped. Call "
                "g.restart() for fresh ranks (their state is lost)."
            )
        if self._closed:
            raise DistributedError(
                "this gang is closed. Call g.restart() for fresh ranks, or create a new "
                "gangrun.Gang(...)."
            )
        assert self._handle is not None
        if self._handle.done():
            self._died(None, before_start=True)
        return self._handle

    def _stop(self, reason: str) -> DistributedError | None:
        """The gang broke: wait for the call's teardown (it stops every rank), release."""
        self._broken = reason
        handle = self._handle
        err: DistributedError | None = None
        if handle is not None:
            try:
                handle.result(timeout=3.0 + self.options.grace_period)
            except TimeoutError:
                handle.cancel(wait=30.0)
            except DistributedError as e:
                err = e
            if err is None:
                try:
                    handle.result(timeout=0)
                except (DistributedError, TimeoutError) as e:
                    err = e if isinstance(e, DistributedError) else None
        release(self._socks, self._dir)
        self._closed = True
        _live.discard(self)
        return err

    def _died(self, rank: int | None, before_start: bool = False) -> None:
        """A rank ended (its connection closed, or the call ended): raise naming it."""
        who = "a rank" if rank is None else f"rank {rank}"
        err = self._stop(f"{who} died")
        if err is not None and err.rank is not None:
            who = f"rank {err.rank}"
            self._broken = f"{who} died"
        detail = f": {err}" if err is not None else "."
        fix = (
            "The other ranks were stopped and the gang is broken: call g.restart() for fresh "
            "ranks (their state is lost)."
            if self.restarts >= self.max_restarts
            else "The other ranks were stopped."
        )
        raise GangError(
            f"{who} of the gang died{detail}\n{fix}",
            rank=rank if err is None else err.rank,
            exitcode=None if err is None else err.exitcode,
            traceback=None if err is None else err.traceback,
            exc_type=None if err is None else err.exc_type,
            run_id=None if err is None else err.run_id,
            failures=None if err is None else err.failures,
            rank_died=True,
            before_start=before_start,
        ) from err


def _close_all() -> None:
    for g in list(_live):
        try:
            g.close(timeout=10.0)
        except Exception:  # at exit: the call machinery's own stop_all still runs after this
            log.warning("gang: closing at exit failed", exc_info=True)


calls.on_exit(_close_all)  # gangs close (FINISHED) before open calls are cancelled (KILLED)
