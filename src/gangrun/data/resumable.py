"""The mid-epoch resume protocol both datasets share (`VolumeDataset`, `TableDataset`).

A dataset keeps ``_epoch``, ``seed``, ``_live`` (the progress record of the current or last
pass, kept up to date by the loader) and ``_resume`` (the position `load_state_dict`
restored, taken once by ``resume_position``); it provides ``rank_world()`` and
``_iterate(start, tagged)``. Its state is ``{"epoch", "seed", "rank<R>": json}``: the rank's
progress lives under its own key so that ``torch.distributed.checkpoint`` (which keeps one
copy of keys shared by ranks) stores every rank's position, and the dataset is ``Stateful``
(``gangrun.checkpoint.save({"data": ds, ...}, url)`` and `gangrun.Checkpointer` work).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Literal

from .split import Position


class ResumableEpochs:
    _epoch: int
    seed: int
    _live: Position | None
    _resume: Position | None
    #: ``{"global_batch": G, "lanes": K}`` when the global batch is held (`gangrun.data.lanes`)
    held: dict[str, int] | None = None
    uneven: Literal["pad", "drop"] = "pad"

    def rank_world(self) -> tuple[int, int]:  # pragma: no cover - each dataset's own
        raise NotImplementedError

    def _iterate(self, start: Position | None, tagged: bool) -> Iterator[Any]:
        raise NotImplementedError  # pragma: no cover - each dataset's own

    def __iter__(self) -> Iterator[Any]:
        from torch.utils.data import get_worker_info

        start = self.resume_position() if get_worker_info() is None else self._resume
        return self._iterate(start, tagged=False)

    def resume_position(self) -> Position | None:  # pragma: no cover - each dataset's
        raise NotImplementedError

    @staticmethod
    def _logical_worker(wid: int, nw: int, start: Position | None) -> int:
        """The worker of the saved pass that DataLoader worker ``wid`` continues.

        A DataLoader hands batches out round-robin over its workers, starting each pass at
        worker 0; a pass resumed mid-epoch must start at the worker the interrupted pass would
        have served next (``start["next"]``), so DataLoader worker ``w`` takes the part of
        worker ``(w + next) % nw``: the batches then come in the uninterrupted order."""
        if start is None:
            return wid
        return (wid + int(start.get("next") or 0)) % nw

    def _deliver(
        self, items: Iterable[tuple[Any, Any]], wid: int, tagged: bool, track: bool
    ) -> Iterator[Any]:
        """The items of ``(item, progress)`` pairs: tagged with the worker (``iter_tagged``),
        or with this process's progress kept up to date (direct iteration), or bare."""
        if tagged:
            for item, progress in items:
                yield item, (wid, progress)
        elif track:
            workers = self._live["workers"]  # type: ignore[index]
            for item, progress in items:
                workers[0] = progress  # a tuple; state_dict() stores it as a JSON list
                yield item
        else:
            for item, _ in items:
                yield item

    def position(self) -> Position | None:
        """The position record of the pass under way (or the last one), as it is now."""
        return self._live

    @property
    def epoch(self) -> int:
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s order; a different epoch than the restored one starts afresh."""
        epoch = int(epoch)
        if epoch != self._epoch:
            self._resume = None
            self._live = None
        self._epoch = epoch

    def record_progress(self, worker: int, progress: Sequence[int] | int) -> None:
        """Note that the training loop received worker ``worker``'s items up to ``progress``
        (the tag ``iter_tagged`` attached to them; the global batch held: the global batches
        of the epoch consumed)."""
        if self._live is None:
            raise RuntimeError("record_progress() before start_progress()")
        if isinstance(progress, int):  # the global batches the world consumed: one number
            self._live["batches"] = progress
            return
        workers = self._live["workers"]
        workers[worker] = list(progress)
        self._live["next"] = (worker + 1) % len(workers)  # the round-robin's next worker

    def iter_tagged(self, start: Position | None = None) -> Iterator[tuple[Any, Any]]:
        """``(item, (worker id, progress))`` pairs of this DataLoader worker's (or this
        process's) share, from position ``start``; does not record progress itself: pass the
        tags the training loop received to ``record_progress``."""
        return self._iterate(start, tagged=True)

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "seed", "rank<R>": <json of this rank's progress>}``."""
        rank, _ = self.rank_world()
        progress = self._live if self._live is not None else self._resume
        return {"epoch": self._epoch, "seed": self.seed, f"rank{rank}": json.dumps(progress)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict``; the next iteration continues where this rank stopped. A
        state that holds the positions of every rank of another world (what
        `gangrun.Checkpointer` restores onto another number of ranks) continues the epoch's
        rest on this world (`gangrun.data.elastic`)."""
        from . import elastic

        rank, _ = self.rank_world()
        self._epoch = int(state["epoch"])
        self._live = None
        recs = {
            r: p
            for r, p in elastic.records_of(state).items()
            if p.get("epoch") == self._epoch and p.get("seed") == self.seed
        }
        held = [p for p in recs.values() if "held" in p]
        marker = next((p for p in recs.values() if "merged" in p), None)
        if held:  # every rank consumed the same global batches: any rank's record holds it
            self._resume = recs.get(rank) or recs[min(recs)]
        elif marker is not None:  # saved again before the resumed pass began
            self._resume = marker
        elif set(recs) - {rank}:
            self._resume = elastic.merged(recs)
        else:
            self._resume = recs.get(rank)

    def resume_summary(self) -> str | None:
        """``"data: the rest of epoch E (X of N rows left)"`` when the restored position is
        every rank's of another world (the pass to come continues the epoch's rest)."""
        start = self._resume
        if start and "held" in start:
            lay = self.lane_layout()
            return (
                f"data at global batch {start.get('batches', 0)} of {lay.batches} of epoch "
                f"{self._epoch} (global batch {lay.global_batch} held)"
            )
        if not start or "merged" not in start:
            return None
        left, total, unit = self._rest_size({"scope": "world", "ranks": start["merged"]})
        return f"data: the rest of epoch {self._epoch} ({left} of {total} {unit} left)"

    def _rest_size(self, base: dict[str, Any]) -> tuple[int, int, str]:  # pragma: no cover
        raise NotImplementedError

    # -- the global batch held (`gangrun.data.lanes`) -------------------------------------------

    def _items(self) -> int:  # pragma: no cover - each dataset's own
        raise NotImplementedError

    def _held_init(self, global_batch: int | None, lanes: int | None, per_item: bool) -> None:
        """Check and keep ``global_batch_size``/``lanes`` (a ``ValueError`` naming what to
        change when this world cannot hold them)."""
        from . import lanes as lanes_

        if global_batch is None:
            if lanes is not None:
                raise ValueError(f"{type(self).__name__}: lanes= needs global_batch_size=")
            self.held = None
            return
        k = lanes_.default_lanes(int(global_batch), per_item) if lanes is None else lanes
        rank, world = self.rank_world()
        lanes_.check(global_batch, k, world, type(self).__name__, rank)
        self.held = {"global_batch": int(global_batch), "lanes": int(k)}

    def lane_layout(self) -> Any:
        from . import lanes as lanes_

        assert self.held is not None
        return lanes_.layout(
            self._items(), self.held["global_batch"], self.held["lanes"], self.uneven
        )

    def held_worker(self, start: Position | None, wid: int, nw: int) -> tuple[Any, range, int]:
        """``(layout, lanes, first batch)`` of DataLoader worker ``wid`` of ``nw`` on this rank."""
        from . import lanes as lanes_

        rank, world = self.rank_world()
        lay = self.lane_layout()
        mine = lanes_.worker_lanes(lanes_.rank_lanes(lay.lanes, rank, world), wid, nw)
        return lay, mine, int(start.get("batches") or 0) if start else 0

    def _held_record(self, nw: int, start: Position | None, **fields: Any) -> Position:
        """The position record of a pass with the global batch held: the global batches of
        the epoch the world consumed (the same number on every rank, whatever its size)."""
        _, world = self.rank_world()
        rec = Position(epoch=self._epoch, seed=self.seed, world_size=world, num_workers=nw)
        rec.update(fields)  # type: ignore[typeddict-item]
        rec["held"] = dict(self.held or {})
        rec["batches"] = int(start.get("batches") or 0) if start else 0
        return rec

    def _held_matches(self, start: Position) -> bool:
        """Whether ``start`` was saved in this dataset's mode (global batch held with the same
        global batch and lanes, or not held); else a warning says the epoch restarts."""
        if start.get("held") == self.held or ("held" not in start and self.held is None):
            return True
        import warnings

        saved = start.get("held")
        warnings.warn(
            f"{type(self).__name__}: the saved position was made with "
            f"{_held_text(saved)}, this dataset has {_held_text(self.held)}; epoch "
            f"{self._epoch} restarts from its beginning (keep global_batch_size= and lanes= "
            "for the whole run).",
            stacklevel=4,
        )
        return False

    def _planned(
        self, start: Position | None, nw: int, same: Any, fresh: Any, warn: bool
    ) -> Position | None:
        """The record a pass of ``nw`` workers starts from (`elastic.plan_start`)."""
        from . import elastic

        rank, world = self.rank_world()
        return elastic.plan_start(start, rank, world, nw, same, fresh, type(self).__name__, warn)


def _held_text(held: dict[str, int] | None) -> str:
    if not held:
        return "no global_batch_size (a per-rank order)"
    return f"global_batch_size={held.get('global_batch')}, lanes={held.get('lanes')}"


__all__ = ["ResumableEpochs"]
