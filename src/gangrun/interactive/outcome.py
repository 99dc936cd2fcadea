"""What an execution hands back: per-rank values, or the error naming the ranks that raised."""

from __future__ import annotations

import logging
import pickle
from typing import Any

from ..errors import DistributedError, GangError
from ..lifecycle.rootcause import rank_failure
from ..wire.records import ErrorRecord, RankFailure

log = logging.getLogger("gangrun.interactive")


class PerRank(list):
    """Per-rank values in rank order; shown one line per rank in a notebook."""

    def _repr_pretty_(self, p: Any, _cycle: bool) -> None:
        p.text("\n".join(f"[rank {r}] {v!r}" for r, v in enumerate(self)))


def wrapped(message: str, err: DistributedError) -> GangError:
    """A gang's own error around ``err``: the message, with the rank, exit code, traceback,
    exception type and every rank's failure of the error underneath."""
    gang = err if isinstance(err, GangError) else None
    return GangError(
        message,
        rank=err.rank,
        exitcode=err.exitcode,
        traceback=err.traceback,
        exc_type=err.exc_type,
        run_id=err.run_id,
        failures=err.failures,
        ranks=gang.ranks if gang else None,
        results=gang.results if gang else None,
        rank_died=gang.rank_died if gang else False,
        before_start=gang.before_start if gang else False,
    )


def failure(
    failed: dict[int, ErrorRecord],
    values: PerRank,
    what: str,
    run_id: str | None,
    nodes: dict[int, str] | None = None,
) -> GangError:
    """The error for an execution that raised on some ranks (the gang stays usable); each
    rank's record becomes its `RankFailure` as a call's does (`rootcause.rank_failure`).
    ``nodes``: the ranks on another node than the caller's, and that node (named in the
    message and in each such rank's failure)."""
    nodes = nodes or {}
    ranks = sorted(failed)
    failures: dict[int, RankFailure] = {}
    for r in ranks:
        f = rank_failure(r, None, failed[r], node=nodes.get(r))
        assert f is not None  # a record is a failure
        failures[r] = f
    first = failures[ranks[0]]
    names = ", ".join(map(str, ranks))
    where = f" on {first.node}" if first.node and len(ranks) == 1 else ""
    lines = [
        f"{what} failed on rank{'s' if len(ranks) > 1 else ''} {names} (of "
        f"{len(values)}){where}: {first.exc_type}: {first.message}",
        "The gang is still usable; ranks that did not fail keep their state.",
    ]
    by_tb: dict[tuple[str, str | None], list[int]] = {}
    for r in ranks:
        by_tb.setdefault((failures[r].traceback or "", failures[r].node), []).append(r)
    for (tb, node), rs in by_tb.items():
        label = ", ".join(map(str, rs)) + (f" on {node}" if node else "")
        lines.append(f"\n[rank{'s' if len(rs) > 1 else ''} {label}] {tb.rstrip()}")
    err = GangError(
        "\n".join(lines),
        rank=ranks[0],
        traceback=first.traceback,
        exc_type=first.exc_type,
        run_id=run_id,
        failures=failures,
        ranks=ranks,
        results=values,
    )
    exc = failed[ranks[0]].exc
    if exc:
        try:
            err.__cause__ = pickle.loads(exc)
        except Exception:  # a class that cannot be rebuilt here: the text says it all
            log.debug("gang: cannot rebuild rank %d's exception", ranks[0], exc_info=True)
    return err
