"""A plain ``torch.utils.data.DataLoader`` in a `gangrun.Checkpointer`'s state: its position.

A ``DataLoader`` has no ``state_dict``. Its order in a pass is drawn at the pass's start from
its generator (``DataLoader(shuffle=True, generator=g)``: the ``RandomSampler`` draws its
permutation from ``g``), and the pass then hands out the batches of that order. So a pass is
resumed exactly from two things: the generator's state at the moment the pass drew its order,
and how many batches the pass had handed out. `track` makes a loader record both:

* its class becomes a subclass of its own class (the instance is otherwise untouched): every index
  sampler a pass starts (``DataLoader._index_sampler``, read by torch at each pass, also by a
  kept worker pool's ``_reset``) is wrapped by `_PassStart`, which notes the generator's state
  before the sampler draws, and, on the first pass after a restore, sets the saved one and
  skips the batches the interrupted pass had handed out (indexes only: no sample is loaded
  for them); an ``IterableDataset`` has no indexes, so its first batches are read and dropped;
* `LoaderState` is the ``Stateful`` the manager saves in the loader's place.

A loader whose sampler (or ``batch_sampler.sampler``) is a `gangrun.data.DistributedSampler`
is resumed by its global position instead (the sampler's order is one global order, split
strided over the ranks): the pass's global start plus ``world * batches handed * batch_size``
(the samples handed for ``batch_size=None``) is saved with the world size, and the resumed
pass of that epoch starts there, on the same or another number of ranks.

A sampler that shuffles with torch's global generator (``shuffle=True`` without
``generator=``) cannot be resumed exactly (its permutation was drawn from a global stream the
manager restores to where it was at the save, not at the pass's start): `track` refuses it,
saying what to pass. Random numbers drawn *inside* DataLoader workers (augmentations) are not
restored: the resumed pass's workers are seeded afresh.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass
class _Pass:
    active: bool = False  # a pass is under way (started, not yet exhausted)
    handed: int = 0  # items (batches) it has handed out
    start_state: Any = None  # the generator's state as the pass drew its order
    restore: Any = None  # the first pass after a restore: the state to draw from...
    skip: int = 0  # ... and the items to skip


def _samplers(loader: Any) -> list[Any]:
    out = [loader.sampler]
    bs = getattr(loader, "batch_sampler", None)
    if bs is not None:
        out += [bs, getattr(bs, "sampler", None)]
    return [s for s in out if s is not None]


def generator(loader: Any) -> Any:
    """The generator the loader's order comes from (``None``: the order is not random, or
    comes from a seed and an epoch, as ``DistributedSampler``'s)."""
    for s in _samplers(loader):
        g = getattr(s, "generator", None)
        if g is not None:
            return g
    return None


def global_random(loader: Any) -> bool:
    """Whether a sampler of the loader shuffles with torch's global generator."""
    from torch.utils.data import RandomSampler, SubsetRandomSampler, WeightedRandomSampler

    kinds = (RandomSampler, SubsetRandomSampler, WeightedRandomSampler)
    return any(isinstance(s, kinds) and s.generator is None for s in _samplers(loader))


class _PassStart:
    """The index sampler of one pass, noting (or setting) the generator's state as it starts."""

    def __init__(self, inner: Any, loader: Any) -> None:
        self.inner = inner
        # weakly: torch's iterator keeps this sampler and the loader keeps a kept-workers
        # iterator; a strong reference would make a cycle, and a loader dropped mid-pass
        # would then end its workers only in a garbage collection, after 5 s per worker
        self._loader = weakref.ref(loader)

    @property
    def loader(self) -> Any:
        return self._loader()

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[Any]:
        # A generator, as torch's samplers are: nothing runs until the pass asks for its
        # first index, which is when a sampler draws its order (after the DataLoader drew its
        # workers' base seed; torch also makes and drops one unused iterator per pass).
        loader = self.loader
        p: _Pass = loader._gangrun_pass
        gen = generator(loader)
        del loader
        if p.restore is not None and gen is not None:
            gen.set_state(p.restore)
        p.restore = None
        p.start_state = gen.get_state() if gen is not None else None
        it = iter(self.inner)
        skip, p.skip = p.skip, 0
        p.handed = skip
        for _ in range(skip):
            next(it)
        yield from it


def _index_sampler(self: Any) -> Any:
    return _PassStart(self._gangrun_base._index_sampler.fget(self), self)


def _iter(self: Any) -> Iterator[Any]:
    from torch.utils.data import IterableDataset

    p: _Pass = self._gangrun_pass
    drop = 0
    if isinstance(self.dataset, IterableDataset):
        drop, p.skip = p.skip, 0  # no indexes to skip: its first items are read and dropped
    it = self._gangrun_base.__iter__(self)
    p.handed = 0 if drop else p.handed
    p.active = True
    for item in it:
        p.handed += 1
        if drop:
            drop -= 1
            continue
        yield item
    p.active = False


def global_sampler(loader: Any) -> Any:
    """The loader's `gangrun.data.DistributedSampler`, if it has one."""
    import sys

    mod = sys.modules.get("gangrun.data.sampler")
    if mod is None:  # never imported: no loader can have one
        return None
    for s in _samplers(loader):
        if isinstance(s, mod.DistributedSampler):
            return s
    return None


def _consumed(loader: Any, handed: int) -> int:
    """Samples of its pass a rank consumed after ``handed`` batches."""
    if loader.batch_size is not None:
        return handed * int(loader.batch_size)
    bs = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    return handed * int(bs) if bs is not None else handed


def world_size() -> int:
    import sys

    dist = sys.modules.get("torch.distributed")
    ready = dist is not None and dist.is_available() and dist.is_initialized()
    return int(dist.get_world_size()) if ready else 1  # type: ignore[union-attr]


def _warn_split(loader: Any, state: dict[str, Any]) -> None:
    """Say that torch's ``DistributedSampler`` resumed on another world size is not exact."""
    from torch.utils.data import DistributedSampler

    saved, world = state.get("world_size"), world_size()
    if saved is None or saved == world:
        return
    if any(isinstance(s, DistributedSampler) for s in _samplers(loader)):
        import warnings

        warnings.warn(
            f"a DataLoader with torch's DistributedSampler saved by {saved} ranks resumes on "
            f"{world}: the batches its pass had handed out are skipped in the new split, so "
            "samples of this epoch may be read twice or not at all. "
            "gangrun.data.DistributedSampler (the same arguments) continues the epoch "
            "exactly on any number of ranks.",
            stacklevel=2,
        )


class LoaderState:
    """What a `gangrun.Checkpointer` saves of a plain DataLoader (see the module docstring)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def state_dict(self) -> dict[str, Any]:
        p: _Pass = self.loader._gangrun_pass
        gen = generator(self.loader)
        sampler = global_sampler(self.loader)
        extra: dict[str, Any] = {}
        if sampler is not None:  # the global position (see the module docstring)
            if p.active:
                extra["sampler"] = sampler.position(_consumed(self.loader, p.handed))
            else:  # no pass under way: the next one starts its epoch
                extra["sampler"] = {**sampler.position(0), "epoch": sampler.epoch, "position": 0}
        if p.active:
            extra["world_size"] = world_size()
            return {"active": True, "generator": p.start_state, "handed": p.handed, **extra}
        gstate = gen.get_state() if gen is not None else None
        return {"active": False, "generator": gstate, **extra}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        p: _Pass = self.loader._gangrun_pass
        gen = generator(self.loader)
        saved = state.get("generator")
        sampler = global_sampler(self.loader)
        if sampler is not None and "sampler" in state:
            # the global position: the resumed pass of its epoch starts there, no skipping
            p.restore, p.skip = None, 0
            sampler.load_state_dict(state["sampler"])
            if gen is not None and saved is not None:
                gen.set_state(saved)
        elif state.get("active"):
            p.restore, p.skip = saved, int(state.get("handed") or 0)
            _warn_split(self.loader, state)
        else:
            p.restore, p.skip = None, 0
            if gen is not None and saved is not None:
                gen.set_state(saved)
        p.active = False


_tracked: dict[type, type] = {}


def track(loader: Any, key: str, rank: int) -> LoaderState:
    """Make ``loader`` (a ``DataLoader`` without ``state_dict``) record its passes; its
    `LoaderState`. A ``TypeError`` naming the key and rank when it cannot be resumed exactly."""
    if global_random(loader):
        raise TypeError(
            f"Checkpointer on rank {rank}: state[{key!r}] is a DataLoader that shuffles with "
            "torch's global random generator, so a resumed pass could not draw the "
            "interrupted pass's order again. Give it a generator of its own: "
            "DataLoader(..., shuffle=True, generator=torch.Generator().manual_seed(seed)) "
            "(or the sampler's generator=)."
        )
    cls = type(loader)
    if not getattr(cls, "_gangrun_base", None):
        sub = _tracked.get(cls)
        if sub is None:  # the loader's own class, its pass start and __iter__ wrapped
            body = {
                "_gangrun_base": cls,
                "_index_sampler": property(_index_sampler),
                "__iter__": _iter,
                "__module__": cls.__module__,
                "__qualname__": cls.__qualname__,
            }
            sub = _tracked[cls] = type(cls.__name__, (cls,), body)
        loader.__class__ = sub
        object.__setattr__(loader, "_gangrun_pass", _Pass())
    return LoaderState(loader)


def is_plain_loader(obj: Any) -> bool:
    """A ``torch.utils.data.DataLoader`` with no state of its own (not a `VolumeLoader`)."""
    import sys

    data = sys.modules.get("torch.utils.data")
    if data is None or not isinstance(obj, data.DataLoader):
        return False
    return not callable(getattr(obj, "state_dict", None))


__all__ = [
    "LoaderState",
    "generator",
    "global_sampler",
    "is_plain_loader",
    "track",
    "world_size",
]
