"""`DistributedSampler`: torch's ``DistributedSampler``, resumable at any world size.

A drop-in for ``torch.utils.data.DistributedSampler`` (the same constructor, ``set_epoch``,
``len``, and a subclass of it): change the import and ``DataLoader(ds, batch_size=b,
sampler=DistributedSampler(ds))`` resumes exactly, on the same or another number of ranks.

**One global order per epoch.** An epoch's order is the permutation torch's sampler draws,
``torch.randperm(len(ds), generator seeded seed + epoch)`` (``range(len(ds))`` without
``shuffle``), from the seed and the epoch alone. Rank ``r`` of ``W`` reads the strided slice
``order[start + r :: W]``, from a global ``start`` offset (0 for a pass from the epoch's
beginning), padded or cut at the epoch's end as torch does (``drop_last``). With ``start = 0``
a pass is exactly torch's. Because the split is strided, once every rank has read ``c``
samples of a pass the world has read exactly the prefix ``order[:start + W * c]``: the
position of the world in the epoch is one number, the same on every rank, whatever ``W``.

**Resumed on another world size.** A pass started at ``start`` on ``W'`` ranks continues the
same global stream: every sample of the epoch is read exactly once across the old and the new
world (the epoch's end is padded with samples from the order's beginning, or cut, as torch
does, for the new world's split), and the next epoch (``start = 0``) is what ``W'`` ranks read
uninterrupted.

**The global batch.** Global batch ``k`` of a pass is ``order[start + k*G : start + (k+1)*G]``
on every world size when each rank's DataLoader takes ``G // W`` samples per batch
(`per_rank_batch`).

**Its position.** The sampler cannot know how many samples the training has consumed (a
DataLoader draws indices ahead: its workers prefetch), so in a `gangrun.Checkpointer`'s state
put the *loader* (a plain ``DataLoader``): the manager counts the batches the loop received
and saves the global position (`gangrun.checkpoint.dataloader`). The sampler's own
``state_dict`` counts the indices it handed out (exact with ``num_workers=0``).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DistributedSampler as _TorchDistributedSampler

from . import split


def _rank_world(
    num_replicas: int | None, rank: int | None, what: str = "DistributedSampler"
) -> tuple[int, int]:
    """``(rank, world)``: the arguments, else torch.distributed's when it is initialised,
    else ``RANK``/``WORLD_SIZE`` by the datasets' strict rule (`split.rank_world`: 0 and 1
    when neither is set, an error naming both when only one is)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
        rank = dist.get_rank() if rank is None else rank
    return split.rank_world(rank, num_replicas, what)


def per_rank_batch(global_batch: int, world_size: int | None = None) -> int:
    """The per-rank batch size that holds ``global_batch`` on ``world_size`` ranks (default:
    this process's world, as `DistributedSampler` finds it): ``global_batch // world_size``.
    A ``ValueError`` when it does not divide."""
    world = world_size if world_size is not None else _rank_world(None, None, "per_rank_batch")[1]
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(
            f"per_rank_batch: global_batch must be an integer >= 1, got {global_batch!r}"
        )
    if world < 1 or global_batch % world:
        raise ValueError(
            f"per_rank_batch: a global batch of {global_batch} samples does not split evenly "
            f"over {world} ranks, so every rank cannot take the same share of each global "
            "batch. Choose a global batch divisible by every number of ranks the run may "
            f"resume on (e.g. {math.lcm(global_batch, world)} for {world}), or run on a number "
            f"of ranks that divides {global_batch}."
        )
    return global_batch // world


def micro_batches(batch: Any, size: int) -> Iterator[tuple[Any, float]]:
    """A rank's batch in micro-batches of at most ``size`` samples, for gradient accumulation
    where the rank's share of the global batch does not fit its memory: ``(micro-batch,
    weight)`` pairs, ``weight`` its share of the batch's samples, so that accumulating
    ``loss(micro) * weight`` gives the gradient of the batch's mean loss. The optimizer steps
    once per batch: the step counter stays the global step.

    ``batch``: a tensor, or a dict / list / tuple of tensors (or of lists) with the samples
    along their first dimension, as a DataLoader collates them; the parts are views (tensors)
    or slices (lists). With DDP, skip the gradient all-reduce of all but the last micro-batch
    (``model.no_sync()``)::

        for i, (micro, w) in enumerate(micro_batches(batch, 64)):
            sync = i == -(-len(batch["x"]) // 64) - 1
            with contextlib.nullcontext() if sync else model.no_sync():
                (loss_fn(model(micro["x"]), micro["y"]) * w).backward()
        opt.step()
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"micro_batches: size must be an integer >= 1, got {size!r}")
    total = _samples(batch)
    for lo in range(0, total, size):
        hi = min(lo + size, total)
        yield _slice(batch, lo, hi), (hi - lo) / total


def _samples(batch: Any) -> int:
    if isinstance(batch, dict):
        counts = {_samples(v) for v in batch.values()}
    elif isinstance(batch, tuple | list) and batch and isinstance(batch[0], torch.Tensor | list):
        counts = {_samples(v) for v in batch}
    elif isinstance(batch, torch.Tensor | list | tuple):
        return len(batch)
    else:
        raise TypeError(f"micro_batches: cannot split a {type(batch).__name__} into samples")
    if len(counts) != 1:
        raise ValueError(f"micro_batches: the batch's parts hold {sorted(counts)} samples")
    return counts.pop()


def _slice(batch: Any, lo: int, hi: int) -> Any:
    if isinstance(batch, dict):
        return {k: _slice(v, lo, hi) for k, v in batch.items()}
    if isinstance(batch, tuple | list) and batch and isinstance(batch[0], torch.Tensor | list):
        return type(batch)(_slice(v, lo, hi) for v in batch)
    return batch[lo:hi]


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The global order of an epoch: torch's ``DistributedSampler`` permutation."""
    if not shuffle:
        return list(range(n))
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(n, generator=g).tolist()


def rank_share(order: list[int], start: int, rank: int, world: int, drop_last: bool) -> list[int]:
    """Rank ``rank``'s share of the part of ``order`` from ``start`` on: the rest of the epoch,
    cut (``drop_last``) or padded from the order's beginning to a multiple of ``world`` (as
    torch's sampler does for a whole epoch), strided."""
    rest = order[min(max(start, 0), len(order)) :]
    if drop_last:
        rest = rest[: len(rest) - len(rest) % world]
    elif rest and len(rest) % world:
        pad = world - len(rest) % world
        rest = rest + (order * math.ceil(pad / len(order)))[:pad]
    return rest[rank::world]


class DistributedSampler(_TorchDistributedSampler):
    """torch's ``DistributedSampler`` with one global order and a resumable global position
    (see the module docstring).

    Args:
        dataset: a map-style dataset (``len`` known).
        num_replicas: the world size (default: torch.distributed's when initialised, else
            ``WORLD_SIZE``, else 1).
        rank: this rank (default: torch.distributed's, else ``RANK``, else 0). Given
            arguments win; from the environment, ``RANK`` without ``WORLD_SIZE`` (or the
            reverse) is a ``ValueError`` naming both, as for the datasets.
        shuffle, seed, drop_last: as torch's.
    """

    def __init__(
        self,
        dataset: Any,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        rank, num_replicas = _rank_world(num_replicas, rank)
        super().__init__(dataset, num_replicas, rank, shuffle, seed, drop_last)
        self.pass_start = 0  # the global start of the pass under way (or the last one)
        self.pass_epoch = 0  # ... and its epoch
        self.yielded = 0  # indices this rank's pass has handed out
        self._resume: tuple[int, int] | None = None  # (epoch, start) of the next pass

    def _size(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[int]:
        return self._iter()

    def _iter(self) -> Iterator[int]:
        # a generator: the pass takes its start when its first index is asked for (a
        # DataLoader makes, and drops, one unused iterator per pass)
        start = 0
        if self._resume is not None:
            epoch, pos = self._resume
            self._resume = None
            start = pos if epoch == self.epoch else 0
        self.pass_start, self.pass_epoch, self.yielded = start, self.epoch, 0
        order = epoch_order(self._size(), self.seed, self.epoch, self.shuffle)
        for i in rank_share(order, start, self.rank, self.num_replicas, self.drop_last):
            self.yielded += 1
            yield i

    def position(self, consumed: int | None = None) -> dict[str, Any]:
        """The world's position in the current pass once every rank consumed ``consumed``
        samples of it (default: the indices this rank handed out): JSON-able."""
        c = self.yielded if consumed is None else int(consumed)
        n = self._size()
        return {
            "epoch": self.pass_epoch,
            "position": min(self.pass_start + self.num_replicas * c, n),
            "world_size": self.num_replicas,
            "len": n,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def state_dict(self) -> dict[str, Any]:
        """The global position of the pass under way (counted from the indices handed out:
        a DataLoader with workers draws ahead; put the loader itself in a Checkpointer)."""
        return self.position()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The next pass of epoch ``state["epoch"]`` continues at the saved global position
        (on any world size); the sampler's epoch is set to it."""
        n = self._size()
        same = (state.get("len"), state.get("seed"), state.get("shuffle")) == (
            n,
            self.seed,
            self.shuffle,
        )
        epoch = int(state.get("epoch", 0))
        self.set_epoch(epoch)
        if not same:
            warnings.warn(
                f"DistributedSampler on rank {self.rank}: the saved position was made for "
                f"{state.get('len')} samples, seed {state.get('seed')}, shuffle="
                f"{state.get('shuffle')}, not {n}, {self.seed}, {self.shuffle}; epoch {epoch} "
                "restarts from its beginning.",
                stacklevel=2,
            )
            self._resume = None
            return
        self._resume = (epoch, int(state.get("position", 0)))

    @property
    def resume_point(self) -> tuple[int, int] | None:
        """``(epoch, global start)`` the next pass of that epoch starts at, after a restore."""
        return self._resume


__all__ = ["DistributedSampler", "epoch_order", "micro_batches", "per_rank_batch", "rank_share"]
