"""What an attempt's ranks left in the run directory: results, error records, and from them
whether an exit is a failure, the root cause, the per-rank results, and the ended attempt's
record."""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

from ..errors import DistributedCancelledError, DistributedError, DistributedTimeoutError
from ..host import diskspace
from ..launch import RankExit
from ..wire import security
from ..wire.records import ErrorRecord, RankFailure
from ..wire.rundir import RunDir
from .rootcause import Candidate, build_error, is_peer_echo, pick, rank_failure
from .state import Attempt, CancelRequested, DeadlineReached, Event, HangDetected, RankExited, State
from .verdict import where_section

if TYPE_CHECKING:
    from .hang import HangGuard

log = logging.getLogger("gangrun.lifecycle.collect")


def _blamed(ev: RankExit) -> bool:
    """Lost where the rank ran (a Ray actor or its node), not by gangrun's own machinery."""
    return ev.lost is not None and not ev.lost.launcher


class RankFiles:
    """One attempt's view of the run directory (error records are read once, then cached)."""

    def __init__(
        self, rundir: RunDir, world_size: int, run_id: str, grace: float, fn_name: str = "fn"
    ) -> None:
        self.rundir = rundir
        self.fn_name = fn_name
        self.world_size = world_size
        self.run_id = run_id
        self.grace = grace
        self._records: dict[int, ErrorRecord | None] = {}

    def record(self, rank: int) -> ErrorRecord | None:
        if rank not in self._records:
            try:
                raw = security.load_private(self.rundir.error(rank))
            except FileNotFoundError:
                raw = None
            except Exception as exc:  # unreadable: judged by its exit status alone
                log.warning("the error record of rank %s could not be read: %s", rank, exc)
                raw = None
            self._records[rank] = ErrorRecord.coerce(raw)
        return self._records[rank]

    def has_result(self, rank: int) -> bool:
        return os.path.exists(self.rundir.result(rank))

    def exit_failed(self, ev: RankExit) -> bool:
        """Whether this exit fails the call while it runs (`rootcause.rank_failure`; a
        ``sys.exit(0)`` before returning does not, unless a peer then fails)."""
        rec = self.record(ev.rank)
        f = rank_failure(ev.rank, ev, rec, rec is None and self.has_result(ev.rank))
        return f is not None and not f.is_clean_exit

    def root_cause(
        self, exits: dict[int, RankExit], first: RankExit, teardown_at: float, pids: dict[int, int]
    ) -> DistributedError:
        candidates: list[Candidate] = []
        late: list[Candidate] = []  # died without a record just after the teardown began
        failures: dict[int, RankFailure] = {}
        late_window = min(1.0, self.grace)
        for rank, ev in exits.items():
            rec = self.record(rank)
            f = rank_failure(rank, ev, rec, self.has_result(rank))
            if f is None:
                continue  # returned normally
            c = Candidate(f.time, rank, ev, rec)
            if rank == first.rank or c.time <= teardown_at:
                candidates.append(c)  # ended (without returning) before the teardown
                failures[rank] = f
            elif (rec is not None or _blamed(ev)) and not f.is_clean_exit:
                failures[rank] = f  # raised (or its node went) in the teardown: kept, not blamed
            elif ev.exitcode != 0 and c.time <= teardown_at + late_window:
                late.append(c)
        lost = sorted(
            r
            for r, ev in exits.items()
            if ev.lost is not None and ev.lost.launcher and self.record(r) is None
        )
        if lost and all(c.rank in lost or is_peer_echo(c.failure) for c in candidates):
            # gangrun's own machinery died under the ranks: no rank is the cause
            return self._launcher_lost(exits, lost, failures)
        cause = pick(candidates, late)
        failures.setdefault(cause.rank, cause.failure)
        err = build_error(
            cause,
            dict(sorted(failures.items())),
            world_size=self.world_size,
            pid=pids.get(cause.rank),
            log_file=self.rundir.log(cause.rank),
            log_dir=self.rundir.logs,
            run_id=self.run_id,
            run_dir=self.rundir.path,
        )
        if cause.record is None and diskspace.looks_full(self.rundir.path):
            head, sep, rest = str(err).partition("\n")
            note = (
                f"It left no error record: the disk of its run directory {self.rundir.path} is "
                f"full ({diskspace.free_bytes(self.rundir.path)} bytes free). Free space there, "
                "or point TMPDIR (where run directories go) at a disk with room."
            )
            err.args = (f"{head}\n{note}{sep}{rest}",)
        return err

    def _launcher_lost(
        self, exits: dict[int, RankExit], lost: list[int], failures: dict[int, RankFailure]
    ) -> DistributedError:
        gone = exits[lost[0]].lost
        assert gone is not None
        why = gone.why
        others = sorted(r for r in range(self.world_size) if r not in lost)
        stopped = f" The other rank(s) {others} were stopped." if others else ""
        hint = f" {gone.hint}" if gone.hint else ""
        msg = (
            f"{why[:1].upper()}{why[1:]} while the call was running: rank(s) {lost} were "
            f"stopped with it.{stopped} No rank failed on its own: the launcher that started "
            "the ranks died, not your code (was it killed, e.g. by the out-of-memory killer? "
            f"check `dmesg`).{hint} Logs: the files in {self.rundir.logs}"
        )
        own = {r: f for r, f in failures.items() if r not in lost}
        return DistributedError(msg, run_id=self.run_id, failures=own)

    def ended(
        self,
        number: int,
        ending: Event | None,
        exits: dict[int, RankExit],
        teardown_at: float,
        pids: dict[int, int],
        guard: HangGuard | None,
    ) -> tuple[Attempt, list[Any] | None]:
        """Attempt ``number``'s record from what ended it (``None``: every rank exited), and
        the per-rank results when it succeeded."""
        name, n, run_id = self.fn_name, self.world_size, self.run_id
        if isinstance(ending, CancelRequested):
            err: DistributedError = DistributedCancelledError(
                f"{name} was {ending.reason}; all {n} ranks were stopped.", run_id=run_id
            )
            return Attempt(number, State.CANCELLED, err), None
        if isinstance(ending, DeadlineReached):
            where = () if guard is None else guard.places
            section = "" if not where else "\nWhere each rank was:\n" + where_section(where)
            err = DistributedTimeoutError(
                f"{name} did not finish within timeout={ending.timeout:g}s; all {n} ranks "
                f"were stopped.{section}",
                run_id=run_id,
                where=where,
            )
            return Attempt(number, State.TIMED_OUT, err), None
        if isinstance(ending, HangDetected):
            assert guard is not None  # only the guard detects hangs
            err = guard.error(name, run_id, self.rundir.logs)
            return Attempt(number, State.HUNG, err), None
        if isinstance(ending, RankExited):
            err = self.root_cause(exits, ending.exit, teardown_at, pids)
            return Attempt(number, State.FAILED, err, dict(err.failures)), None
        try:
            results = self.collect()
        except DistributedError as exc:
            ended = State.CANCELLED if hasattr(exc, "resume") else State.FAILED  # preempted
            return Attempt(number, ended, exc, dict(exc.failures)), None
        return Attempt(number, State.SUCCEEDED), results

    def collect(self) -> list[Any]:
        """Every rank's return value, rank-ordered (``None`` for a rank that ended with
        ``sys.exit(0)`` when every rank ended cleanly); results are removed once read. Ranks
        that stopped after a preemption checkpoint: `DistributedPreemptedError`."""
        from .checkpoints import preempted_error

        preempted = preempted_error(self.rundir, self.world_size, self.run_id, self.fn_name)
        if preempted is not None:
            raise preempted
        out: list[Any] = []
        for r in range(self.world_size):
            p = self.rundir.result(r)
            if not os.path.exists(p):
                rec = self.record(r)
                if rec is not None and rec.is_clean_exit:
                    out.append(None)
                    continue
                f = rank_failure(r, RankExit(r, 0, time.time()), rec)  # its result is gone
                raise DistributedError(
                    f"Rank {r} exited with code 0 before returning a result.",
                    rank=r,
                    exitcode=0,
                    run_id=self.run_id,
                    failures={r: f} if f is not None else None,
                )
            try:
                out.append(security.load_private(p))  # only from a 0700 dir of this user
            except Exception as exc:
                raise DistributedError(
                    f"The result of rank {r} could not be loaded in the caller: "
                    f"{type(exc).__name__}: {exc}. Is its class importable here?",
                    rank=r,
                    run_id=self.run_id,
                ) from exc
            finally:
                if os.path.exists(p):
                    os.unlink(p)
        return out


__all__ = ["RankFiles"]
