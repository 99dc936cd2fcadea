"""Which failed rank is the root cause, every rank's failure, and the error the caller gets.

A rank killed by a signal (SIGKILL, SIGSEGV, ``os._exit``) leaves no error record; the caller
only learns of it when its ``waitpid`` thread runs, which on a busy machine can be *after* a
peer blocked in a collective has noticed the closed connection, raised, and written an error
record with an earlier timestamp. Sorting by time alone then blames the peer (measured: 7 of 8
runs with a SIGKILLed rank and a peer inside ``all_reduce``). So errors that are the *echo* of
a peer's death (gloo/NCCL/store connection errors) rank behind every other failure.

The error record is authoritative: a rank that wrote one failed, whatever its exit status
said (a caller that ignores ``SIGCHLD`` sees every exit as 0); a rank that ended with neither
a result nor a record failed too ("exited with code 0 before returning").
"""

from __future__ import annotations

import logging
import os
import pickle
import re
import signal
from dataclasses import dataclass

from ..errors import DistributedError, signal_name
from ..launch import RankExit
from ..records import ErrorRecord, RankFailure

log = logging.getLogger("gangrun.lifecycle.rootcause")

_PEER_ECHO = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|"
    r"remote worker crash|remote process exited|NCCL communicator was aborted|"
    r"ProcessGroupGloo.*(?:Timed out|closed)|DistNetworkError|DistStoreError|"
    r"recvValue failed|Socket Timeout|Connection refused",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class Candidate:
    """A rank that failed: when, how it exited, and its error record (None: no record)."""

    time: float
    rank: int
    exit: RankExit
    record: ErrorRecord | None


def is_peer_echo(rec: ErrorRecord | None) -> bool:
    """The rank failed because a peer went away (not a cause of its own)."""
    if rec is None:
        return False
    return bool(_PEER_ECHO.search(f"{rec.exc_type}: {rec.message}"))


def pick(candidates: list[Candidate], late: list[Candidate]) -> Candidate:
    """The root cause among ``candidates`` (failures before the teardown). ``late``:
    record-less deaths seen just after the teardown began that were not caused by it (not
    SIGTERM); they are only preferred over peer echoes."""
    own = [c for c in candidates if not is_peer_echo(c.record)]
    if own:
        return min(own, key=lambda c: (c.time, c.rank))
    late = [c for c in late if c.exit.exitcode != -signal.SIGTERM]
    if late:
        return min(late, key=lambda c: (c.time, c.rank))
    return min(candidates, key=lambda c: (c.time, c.rank))


def exit_failed(ev: RankExit, rec: ErrorRecord | None, has_result: bool) -> bool:
    """Whether this exit is a failure while the call runs: a nonzero status, an error record
    (other than a clean ``sys.exit(0)``), or exit 0 with neither a result nor a record."""
    if rec is not None:
        return not rec.is_clean_exit
    return ev.exitcode != 0 or not has_result


def failure_of(c: Candidate) -> RankFailure:
    rec, code = c.record, c.exit.exitcode
    if rec is not None:
        exitcode = rec.exitcode if rec.exitcode is not None else (code or 1)
        return RankFailure(
            rank=c.rank,
            exitcode=exitcode,
            signal=signal_name(code),
            exc_type=rec.exc_type,
            message=rec.message if not rec.is_clean_exit else _early(code),
            traceback=rec.traceback or None,
            time=c.time,
            frame=rec.frame,
        )
    sig = signal_name(code)
    what = f"killed by {sig}" if sig else _early(code) if code == 0 else f"exited with code {code}"
    return RankFailure(c.rank, code, sig, None, what, None, c.time)


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


def build_error(
    cause: Candidate,
    failures: dict[int, RankFailure],
    *,
    world_size: int,
    pid: int | None,
    log_file: str,
    log_dir: str,
    run_id: str,
) -> DistributedError:
    """The caller's error: the root cause first, then the others stopped, every failure kept."""
    rank, rec, code = cause.rank, cause.record, cause.exit.exitcode
    log_tail = tail(log_file)
    sig = signal_name(code)
    others = sorted(r for r in range(world_size) if r != rank)
    if rec is not None and rec.is_clean_exit:
        head = (
            f"Rank {rank} (pid {pid}) exited with code 0 before returning (sys.exit while its "
            "peers were still running)."
        )
        body = log_tail
    elif rec is not None and rec.exc_type != "SystemExit":
        head = f"Rank {rank} (pid {pid}) failed: {rec.exc_type}: {rec.message}"
        body = rec.traceback
    elif rec is not None:
        head = f"Rank {rank} (pid {pid}) exited with code {rec.exitcode} (sys.exit)."
        body = log_tail
    elif sig is not None:
        hint = ""
        if sig == "SIGKILL":
            hint = " (often the out-of-memory killer: check `dmesg`, lower the batch size)"
        elif sig == "SIGSEGV":
            hint = " (a crash in native code: the log below holds the Python stack)"
        head = f"Rank {rank} (pid {pid}) was killed by {sig}{hint}."
        body = log_tail
    elif code == 0:
        head = f"Rank {rank} (pid {pid}) exited with code 0 before returning a result."
        body = log_tail
    else:
        head = f"Rank {rank} (pid {pid}) exited with code {code} without a Python exception."
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
        traceback=(rec.traceback or None) if rec else None,
        exc_type=rec.exc_type if rec else None,
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


__all__ = ["Candidate", "is_peer_echo", "pick", "exit_failed", "failure_of", "build_error"]
