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
from collections.abc import Iterator, Sequence
from typing import Any


class ResumableEpochs:
    _epoch: int
    seed: int
    _live: dict[str, Any] | None
    _resume: dict[str, Any] | None

    def rank_world(self) -> tuple[int, int]:  # pragma: no cover - each dataset's own
        raise NotImplementedError

    def _iterate(self, start: dict[str, Any] | None, tagged: bool) -> Iterator[Any]:
        raise NotImplementedError  # pragma: no cover - each dataset's own

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

    def record_progress(self, worker: int, progress: Sequence[int]) -> None:
        """Note that the training loop received worker ``worker``'s items up to ``progress``
        (the tag ``iter_tagged`` attached to them)."""
        if self._live is None:
            raise RuntimeError("record_progress() before start_progress()")
        self._live["workers"][worker] = list(progress)

    def iter_tagged(self, start: dict[str, Any] | None = None) -> Iterator[tuple[Any, Any]]:
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
        """Restore ``state_dict``; the next iteration continues where this rank stopped."""
        rank, _ = self.rank_world()
        self._epoch = int(state["epoch"])
        self._live = None
        raw = state.get(f"rank{rank}")
        progress = json.loads(raw) if isinstance(raw, (str, bytes)) else raw
        if progress is not None and (
            progress.get("epoch") != self._epoch or progress.get("seed") != self.seed
        ):
            progress = None
        self._resume = progress


__all__ = ["ResumableEpochs"]
