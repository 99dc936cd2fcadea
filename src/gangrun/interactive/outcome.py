"""What an execution hands back: per-rank values, or the error naming the ranks that raised."""

from __future__ import annotations

import logging
import pickle
from typing import Any

from ..errors import DistributedError

log = logging.getLogger("gangrun.interactive")


class PerRank(list):  # type: ignore[type-arg]
    """Per-rank values in rank order; shown one line per rank in a notebook."""

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text("\n".join(f"[rank {r}] {v!r}" for r, v in enumerate(self)))


def wrapped(message: str, err: DistributedError) -> DistributedError:
    """A gang's own error around ``err``: the message, with the rank, exit code, traceback
    and exception type of the failure underneath."""
    return DistributedError(
        message,
        rank=err.rank,
        exitcode=err.exitcode,
        traceback=err.traceback,
        exc_type=err.exc_type,
        run_id=err.run_id,
    )


def failure(
    failed: dict[int, dict[str, Any]], values: PerRank, what: str, run_id: str | None
) -> DistributedError:
    """The error for an execution that raised on some ranks (the gang stays usable)."""
    ranks = sorted(failed)
    first = failed[ranks[0]]
    names = ", ".join(map(str, ranks))
    lines = [
        f"{what} failed on rank{'s' if len(ranks) > 1 else ''} {names} (of "
        f"{len(values)}): {first['exc_type']}: {first['message']}",
        "The gang is still usable; ranks that did not fail keep their state.",
    ]
    by_tb: dict[str, list[int]] = {}
    for r in ranks:
        by_tb.setdefault(failed[r]["traceback"], []).append(r)
    for tb, rs in by_tb.items():
        label = ", ".join(map(str, rs))
        lines.append(f"\n[rank{'s' if len(rs) > 1 else ''} {label}] {tb.rstrip()}")
    err = DistributedError(
        "\n".join(lines),
        rank=ranks[0],
        traceback=first["traceback"],
        exc_type=first["exc_type"],
        run_id=run_id,
    )
    err.ranks = ranks  # type: ignore[attr-defined]
    err.results = values  # type: ignore[attr-defined]
    if first.get("exc"):
        try:
            err.__cause__ = pickle.loads(first["exc"])
        except Exception:  # a class that cannot be rebuilt here: the text says it all
            log.debug("gang: cannot rebuild rank %d's exception", ranks[0], exc_info=True)
    return err
