"""Which failed rank is the root cause, every rank's failure, and the error the caller gets.

A rank killed by a signal (SIGKILL, SIGSEGV, ``os._exit``) leaves no error record; the caller
only learns of it when its ``waitpid`` thread runs, which on a busy machine can be *after* a
peer blocked in a collective has noticed the closed connection, raised, and written an error
record with an earlier timestamp. Sorting by time alone then blames the peer (measured: 7 of 8
runs with a SIGKILLed rank and a peer inside ``all_reduce``). So errors that are the *echo* of
a peer's death (gloo/NCCL/store connection errors) rank behind every other failure.

Where a rank's exit becomes an error is one function, `rank_failure`: the exit the launcher
saw, the error record the rank wrote and whether it left a result go in, the rank's
`RankFailure` (or ``None``: it returned) comes out. The error record is authoritative: a rank
that wrote one failed, whatever its exit status said (a caller that ignores ``SIGCHLD`` sees
every exit as 0); a rank that ended with neither a result nor a record failed too ("exited
with code 0 before returning"); a rank its launcher lost (`gangrun.launch.LostRank`: a dead
fork server, a lost Ray actor, a failed wait) failed as the launcher says. The call's ranks
(`lifecycle.collect`), the interactive gang's executions (`interactive.outcome`) and the
launchers' special cases all go through it.

What an exception's type and message say of a failure is decided here too, in one list each:
the echo of a peer's death, a transient failure of the network, a collective or the hardware
(`is_transient_exception`), a backend that cannot be used on this machine
(`unavailable_backend`). The restart policy (`gangrun.lifecycle.policy`) reads them from here.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
import signal
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import PEER_ECHO_TEXT, DistributedError, signal_name
from ..launch import RankExit
from ..wire.records import ErrorRecord, RankFailure

if TYPE_CHECKING:
    from .oom import OomVerdict

log = logging.getLogger("gangrun.lifecycle.rootcause")

# Exception types (the last part of the qualified name) that say the network, a peer or the
# clock failed, not the code: a retry can succeed.
TRANSIENT_TYPES = frozenset(
    {
        "TimeoutError",
        "ConnectionError",
        "ConnectionResetError",
        "ConnectionAbortedError",
        "ConnectionRefusedError",
        "BrokenPipeError",
        "KeyboardInterrupt",  # SIGINT sent to the rank from outside: a signal, not the code
        "DistNetworkError",
        "DistStoreError",
        "DistBackendError",
        "timeout",  # socket.timeout
    }
)
# Messages that say the network, a collective or the hardware failed: worth retrying. The
# first are those that say a peer went away (`gangrun.errors.PEER_ECHO_TEXT`, a leaf module:
# the live output folds such tracebacks too): `pick` ranks a failure with one behind every
# other failure (it is the echo of a peer's death), and the restart policy retries it.
TRANSIENT_TEXT = (
    *PEER_ECHO_TEXT,
    "NCCL",  # an NCCL error or timeout (not one of UNAVAILABLE_TEXT: checked first)
    "Watchdog caught collective",
    "collective operation timeout",
    "uncorrectable ECC error",
)
# Messages that say the process group's backend cannot be used at all, in this torch or on
# this machine (``init_process_group("nccl")`` on a CPU-only torch or a node without GPUs):
# certain to repeat, whatever the exception type, after progress or not.
UNAVAILABLE_TEXT = (
    r"Distributed package doesn't have \w+ built in",
    "ProcessGroupNCCL is only supported with GPUs",
    "NCCL (?:backend )?is not available",
    "NCCL support is not compiled",
)


def any_of(texts: tuple[str, ...]) -> re.Pattern[str]:
    """One case-insensitive pattern matching any of ``texts`` (regular expressions)."""
    return re.compile("|".join(texts), re.IGNORECASE)


_TRANSIENT = any_of(TRANSIENT_TEXT)
_UNAVAILABLE = any_of(UNAVAILABLE_TEXT)
_PEER_ECHO = any_of(PEER_ECHO_TEXT)


def unavailable_backend(exc_type: str, message: str) -> str | None:
    """The words of the exception that say the distributed backend cannot be used here (an
    NCCL-less torch, no GPUs), or None."""
    m = _UNAVAILABLE.search(f"{exc_type}: {message}")
    return m.group(0) if m else None


def is_transient_exception(exc_type: str, message: str) -> bool:
    """The exception says a peer, the network or the hardware failed (worth retrying); never
    one that says the backend is not available (`unavailable_backend`)."""
    if unavailable_backend(exc_type, message) is not None:
        return False
    if exc_type.startswith("ray."):  # a lost actor or node (gangrun.launch.ray)
        return True
    if exc_type.rpartition(".")[2] in TRANSIENT_TYPES:
        return True
    return bool(_TRANSIENT.search(f"{exc_type}: {message}"))


def rank_failure(
    rank: int,
    exit: RankExit | None,
    record: ErrorRecord | None,
    has_result: bool = False,
    node: str | None = None,
) -> RankFailure | None:
    """Where a rank's exit becomes an error: its `RankFailure`, or ``None`` when it returned.

    ``exit`` is how its launcher saw it end (``None``: it did not end, e.g. an interactive
    gang's execution that raised), ``record`` the error record it wrote, ``has_result``
    whether it left a result. In order: a record is authoritative (a ``sys.exit(0)`` before
    returning gives a failure whose ``is_clean_exit`` is true: a failure only if a peer then
    fails); a rank the launcher lost (``exit.lost``) failed as the launcher tells; exit 0 with
    a result returned; any other exit failed (killed by a signal, an exit code, or exit 0
    before returning). ``node`` (default: ``exit.node``) is where a rank on another node
    than the caller's ran: every failure of such a rank names it."""
    code = exit.exitcode if exit is not None else None
    if node is None and exit is not None:
        node = exit.node
    if record is not None:
        if record.exitcode is not None:
            exitcode: int | None = record.exitcode
        else:
            exitcode = (code or 1) if exit is not None else None
        return RankFailure(
            rank=rank,
            exitcode=exitcode,
            signal=signal_name(code),
            exc_type=record.exc_type,
            message=record.message if not record.is_clean_exit else _early(code or 0),
            traceback=record.traceback or None,
            time=record.time,
            frame=record.frame,
            node=node,
        )
    if exit is None:
        return None
    sig = signal_name(code)
    if exit.lost is not None:
        lost = exit.lost
        detail = lost.detail or None
        return RankFailure(rank, code, sig, lost.exc_type, lost.why, detail, exit.time, node=node)
    if code == 0 and has_result:
        return None
    what = f"killed by {sig}" if sig else _early(code) if code == 0 else f"exited with code {code}"
    return RankFailure(rank, code, sig, None, what, None, exit.time, node=node)


@dataclass(frozen=True)
class Candidate:
    """A rank that failed: when, how it exited, and its error record (None: no record)."""

    time: float
    rank: int
    exit: RankExit
    record: ErrorRecord | None

    @property
    def failure(self) -> RankFailure:
        """The rank's failure (`rank_failure`)."""
        f = rank_failure(self.rank, self.exit, self.record)
        assert f is not None  # no result: a candidate never returned
        return f


def is_peer_echo(f: RankFailure | None) -> bool:
    """The rank failed because a peer went away (not a cause of its own)."""
    if f is None or f.exc_type is None:
        return False
    return bool(_PEER_ECHO.search(f"{f.exc_type}: {f.message}"))


def pick(candidates: list[Candidate], late: list[Candidate]) -> Candidate:
    """The root cause among ``candidates`` (failures before the teardown). ``late``:
    record-less deaths seen just after the teardown began that were not caused by it (not
    SIGTERM); they are only preferred over peer echoes."""
    own = [c for c in candidates if not is_peer_echo(c.failure)]
    if own:
        return min(own, key=lambda c: (c.time, c.rank))
    late = [c for c in late if c.exit.exitcode != -signal.SIGTERM]
    if late:
        return min(late, key=lambda c: (c.time, c.rank))
    return min(candidates, key=lambda c: (c.time, c.rank))


def _early(code: int) -> str:
    return f"exited with code {code} before returning"


def tail(path: str, lines: int = 30) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 16384))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _oom_verdict(
    run_dir: str | None, rank: int, pid: int | None, died_at: float
) -> OomVerdict | None:
    from .oom import explain

    try:
        return explain(run_dir, rank, pid, died_at)
    except Exception:  # the host's files are odd: the plain SIGKILL text stays
        log.debug("no out-of-memory verdict for rank %s", rank, exc_info=True)
        return None


def _worker_oom(run_dir: str | None, rank: int, message: str) -> str | None:
    from .oom import explain_worker

    try:
        return explain_worker(run_dir, rank, message)
    except Exception:  # the host's files are odd: torch's words stay alone
        log.debug("no out-of-memory verdict for rank %s's worker", rank, exc_info=True)
        return None


def build_error(
    cause: Candidate,
    failures: dict[int, RankFailure],
    *,
    world_size: int,
    pid: int | None,
    log_file: str,
    log_dir: str,
    run_id: str,
    run_dir: str | None = None,
) -> DistributedError:
    """The caller's error: the root cause first, then the others stopped, every failure kept.
    ``run_dir``: where the ranks' memory samples are (a SIGKILL's out-of-memory verdict)."""
    rank, rec, code, f = cause.rank, cause.record, cause.exit.exitcode, cause.failure
    log_tail = tail(log_file)
    others = sorted(r for r in range(world_size) if r != rank)
    who = f"Rank {rank} (pid {pid}){f' on {f.node}' if f.node else ''}"
    if f.is_clean_exit:
        head = (
            f"{who} exited with code 0 before returning (sys.exit while its "
            "peers were still running)."
        )
        body = log_tail
    elif f.exc_type is not None and f.exc_type != "SystemExit":
        head = f"{who} failed: {f.exc_type}: {f.message}"
        worker = None
        if "DataLoader worker" in head and not f.node:
            worker = _worker_oom(run_dir, rank, f.message)
        head += f"\n{worker}" if worker else ""
        body = f.traceback or ""
    elif f.exc_type is not None:
        head = f"{who} exited with code {f.exitcode} (sys.exit)."
        body = log_tail
    elif f.signal is not None:
        hint = ""
        # this node's kernel log and cgroups say nothing of a rank on another node
        here = f.signal == "SIGKILL" and not f.node
        oom = _oom_verdict(run_dir, rank, pid, cause.exit.time) if here else None
        if f.signal == "SIGKILL":
            hint = " (no out-of-memory kill of it is on record here: check `dmesg`)"
        elif f.signal == "SIGSEGV":
            hint = " (a crash in native code: the log below holds the Python stack)"
        head = f"{who} was killed by {f.signal}{hint}."
        if oom is not None:
            from .oom import what_to_do

            head = f"{oom.text(who)}. {what_to_do(oom)}"
        body = log_tail
    elif code == 0:
        head = f"{who} exited with code 0 before returning a result."
        body = log_tail
    else:
        head = f"{who} exited with code {code} without a Python exception."
        body = log_tail
    also = sorted(r for r in failures if r != rank)
    more = f"Rank(s) {also} failed as well (err.failures). " if also else ""
    stopped = [r for r in others if r not in failures]
    extra = f"The other rank(s) {stopped} were stopped. " if stopped else ""
    # Paragraphs one blank line apart; a rank that died with nothing in its log (a signal,
    # os._exit) has no body, and leaves no gap either.
    paragraphs = (
        head,
        (body or "").strip("\n").rstrip(),
        f"{more}{extra}Full logs: err.logs(rank), or the files in {log_dir}",
    )
    msg = "\n\n".join(p for p in paragraphs if p.strip())
    err = DistributedError(
        msg,
        rank=rank,
        exitcode=failures[rank].exitcode if rank in failures else code,
        traceback=f.traceback,
        exc_type=f.exc_type,
        log_tail=log_tail,
        run_id=run_id,
        failures=failures,
    )
    if rec is not None and rec.exc is not None:
        try:
            cause_exc = pickle.loads(rec.exc)
            if isinstance(cause_exc, BaseException):
                err.__cause__ = cause_exc
        except Exception as exc:  # its class is not importable here: the text says enough
            log.debug("rank %s's exception could not be rebuilt: %s", rank, exc)
    return err


__all__ = [
    "TRANSIENT_TEXT",
    "TRANSIENT_TYPES",
    "UNAVAILABLE_TEXT",
    "Candidate",
    "any_of",
    "build_error",
    "is_peer_echo",
    "is_transient_exception",
    "pick",
    "rank_failure",
    "unavailable_backend",
]
