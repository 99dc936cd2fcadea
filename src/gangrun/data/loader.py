"""`VolumeLoader`: a ``DataLoader`` that keeps a [`VolumeDataset`][gangrun.data.VolumeDataset]'s position exact.

Workers iterate the dataset's `iter_tagged` view, so every sample carries
(worker id, progress); the collate function keeps the last tag of each batch, and the loader
hands it to `record_progress` as the batch reaches the training loop.

With ``persistent_workers=True`` the workers outlive the pass, so they cannot take the
epoch and the resume position from the dataset they were forked with: the loader writes
both into an `EpochChannel` (shared memory the workers inherit) before each pass, and each
worker reads it as its pass starts (torch's DataLoader starts a persistent worker's pass
with a fresh ``iter(dataset)``, after the loader sent it the pass's first request, so the
write is visible).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

from torch.utils.data import DataLoader, IterableDataset

from .split import Position


class Resumable(Protocol):
    """The public resume API of [`VolumeDataset`][gangrun.data.VolumeDataset] that the loader uses."""

    @property
    def epoch(self) -> int: ...

    def set_epoch(self, epoch: int) -> None: ...

    def resume_position(self) -> Position | None: ...

    def start_progress(self, num_workers: int, start: Position | None = None) -> None: ...

    def iter_tagged(self, start: Position | None = None) -> Iterator[Any]: ...

    def record_progress(self, worker: int, progress: Any) -> None: ...


class EpochChannel:
    """The epoch and resume position of the pass starting now, from the training process to
    its persistent DataLoader workers: JSON in a shared memory block made before they start
    (a worker started by ``spawn`` receives the block with the dataset)."""

    CAPACITY = 1 << 20

    def __init__(self) -> None:
        import torch

        storage = torch.UntypedStorage._new_shared(self.CAPACITY)
        self.block = torch.empty(0, dtype=torch.uint8).set_(storage)

    def write(self, epoch: int, start: Position | None) -> None:
        import json

        raw = json.dumps({"epoch": int(epoch), "start": start}).encode()
        if len(raw) + 8 > self.CAPACITY:
            raise RuntimeError(
                f"the resume position ({len(raw)} bytes) does not fit the persistent workers' "
                f"channel ({self.CAPACITY} bytes); use persistent_workers=False"
            )
        arr = self.block.numpy()
        arr[8 : 8 + len(raw)] = memoryview(raw)
        arr[:8] = memoryview(len(raw).to_bytes(8, "little"))

    def read(self) -> tuple[int, Position | None]:
        import json

        arr = self.block.numpy()
        n = int.from_bytes(arr[:8].tobytes(), "little")
        msg = json.loads(arr[8 : 8 + n].tobytes())
        return int(msg["epoch"]), msg["start"]


class _TaggedView(IterableDataset):
    """What the loader's workers iterate: samples tagged with (worker id, progress)."""

    def __init__(self, volume: Resumable, channel: EpochChannel | None = None) -> None:
        self.volume = volume
        self.start: Position | None = None
        self.channel = channel

    def __iter__(self) -> Iterator[Any]:
        from torch.utils.data import get_worker_info

        start = self.start
        if self.channel is not None and get_worker_info() is not None:
            epoch, start = self.channel.read()  # a persistent worker: this pass's
            self.volume.set_epoch(epoch)
        return self.volume.iter_tagged(start)

    def __len__(self) -> int:
        """The dataset's ``len`` (samples per rank and epoch; a `TableDataset`: batches), so
        ``len(loader)`` is what it is for the dataset itself."""
        inner: Any = getattr(self.volume, "ds", self.volume)  # TableLoader's view: its dataset
        return len(inner)


class _Collate:
    def __init__(self, inner: Callable[[Any], Any] | None, batched: bool) -> None:
        self.inner = inner
        self.batched = batched

    def __call__(self, items: Any) -> Any:
        from torch.utils.data import default_collate, default_convert

        if self.batched:
            samples = [s for s, _ in items]
            return (self.inner or default_collate)(samples), items[-1][1]
        sample, tag = items
        return (self.inner or default_convert)(sample), tag


class VolumeLoader(DataLoader):
    """``DataLoader`` for a [`VolumeDataset`][gangrun.data.VolumeDataset] that reports the rank's exact progress.

    Takes the usual ``DataLoader`` arguments (``batch_size``, ``num_workers``, ``collate_fn``,
    ``pin_memory``, ``persistent_workers``, ...). Every batch carries, from its worker, how
    far that worker got; the loader records it in the dataset as the batch is handed out, so
    ``dataset.state_dict()`` counts exactly the batches the training loop received. With
    ``persistent_workers=True`` the workers are started once and each pass tells them the
    dataset's epoch and resume position (other changes to the dataset after the first pass
    do not reach them).
    """

    def __init__(self, dataset: Resumable, **kwargs: Any) -> None:
        if "sampler" in kwargs or "batch_sampler" in kwargs or kwargs.get("shuffle"):
            raise ValueError("VolumeDataset does its own sharding and shuffling")
        self.volume = dataset
        self._held = getattr(dataset, "held", None)
        self.held_collate: Callable[[Any], Any] | None = None
        if self._held is not None:  # workers yield parts of batches; joined here
            _, world = dataset.rank_world()  # type: ignore[attr-defined]
            share = self._held["global_batch"] // world
            given = kwargs.pop("batch_size", None)
            if given not in (None, share):
                raise ValueError(
                    f"the dataset holds global_batch_size={self._held['global_batch']}: each of "
                    f"the {world} ranks' batches is its share ({share}); leave the loader's "
                    f"batch_size unset (got {given})"
                )
            self.held_collate = kwargs.pop("collate_fn", None)
            kwargs.update(batch_size=None, collate_fn=identity)
        persistent = bool(kwargs.get("persistent_workers")) and _workers(kwargs) > 0
        self._channel = EpochChannel() if persistent else None
        self._view = _TaggedView(dataset, self._channel)
        if kwargs.get("generator") is None:
            # torch's DataLoader draws each iteration's worker base seed from this generator,
            # by default the global RNG: a private one (saved in state_dict) keeps the training
            # loop's random stream the same whether or not the loop was resumed mid-run.
            import torch

            seed = int(getattr(dataset, "seed", 0))
            kwargs["generator"] = torch.Generator().manual_seed(seed)
        if self._held is None:
            kwargs["collate_fn"] = _Collate(
                kwargs.get("collate_fn"), kwargs.get("batch_size", 1) is not None
            )
        super().__init__(self._view, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        """The dataset's position (what `gangrun.Checkpointer` saves of a loader)."""
        state = dict(self.volume.state_dict())  # type: ignore[attr-defined]
        if self.generator is not None:
            state["loader_generator"] = self.generator.get_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a saved position: the next ``iter(loader)`` continues mid-epoch."""
        state = dict(state)
        gen = state.pop("loader_generator", None)
        if gen is not None and self.generator is not None:
            self.generator.set_state(gen)
        self.volume.load_state_dict(state)  # type: ignore[attr-defined]

    def _begin_pass(self) -> None:
        """Take the restored position for the pass starting now, start recording it, and
        tell persistent workers the epoch and the position."""
        ds = self.volume
        start = ds.resume_position()
        self._view.start = start
        ds.start_progress(max(1, int(self.num_workers)), start)
        if self._channel is not None:
            self._channel.write(ds.epoch, start)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        self._begin_pass()
        if self._held is not None:
            yield from self._joined(super().__iter__())
            return
        for batch, (wid, progress) in super().__iter__():
            self.volume.record_progress(wid, progress)
            yield batch

    def _joined(self, parts: Iterator[Any]) -> Iterator[Any]:
        """The global batch held: each worker's part of the rank's batch ``k`` comes in turn
        (the DataLoader takes its workers round-robin, in order); ``nw`` consecutive parts are
        joined into the batch, in worker order, i.e. lane order (`gangrun.data.lanes`)."""
        from torch.utils.data import default_collate

        nw = max(1, int(self.num_workers))
        join = getattr(self.volume, "held_join", None)
        collate = self.held_collate or default_collate
        got: list[Any] = []
        for part, (wid, progress) in parts:
            got.append(part)
            if len(got) < nw:
                continue
            if join is not None:
                batch = collate(join(got))
            else:
                batch = collate([s for p in got if p for s in p])
            got = []
            self.volume.record_progress(wid, progress)
            yield batch

    def __len__(self) -> int:
        if self._held is not None:  # the rank's batches of an epoch (a worker yields parts)
            return int(self.volume.lane_layout().batches)  # type: ignore[attr-defined]
        return super().__len__()


def identity(x: Any) -> Any:
    """What the workers' collate does with a held global batch's parts: nothing."""
    return x


def _workers(kwargs: dict[str, Any]) -> int:
    return int(kwargs.get("num_workers", 0) or 0)


def keep_workers_by_default(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``ds.loader(...)``'s DataLoader arguments: workers are kept across epochs unless
    ``persistent_workers`` is given."""
    kwargs.setdefault("persistent_workers", _workers(kwargs) > 0)
    return kwargs


__all__ = ["EpochChannel", "VolumeLoader", "keep_workers_by_default"]
