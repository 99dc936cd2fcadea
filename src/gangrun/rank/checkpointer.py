"""The checkpoint manager of a call: restore the newest complete checkpoint, save every N
steps (asynchronously), keep the last K, stop cleanly on a preemption.

Inside the function::

    ckpt = gangrun.Checkpointer({"model": model, "optim": opt, "sched": sched,
                                 "loader": loader}, every=100, keep=3)
    for step in ckpt.steps(total):          # starts at the restored step (0 on a fresh run)
        loss = train_step(next(batches))
        ckpt.log_metrics({"loss": loss}, step)   # exactly once per step, whatever restarts

Where checkpoints live: the call's ``checkpoint_dir`` option (any fsspec URL or directory;
a ``run_id=`` call reuses the one its MLflow run recorded), or ``Checkpointer(dir=...)``.
One checkpoint is the directory ``<dir>/step-<N>`` written by
`gangrun.checkpoint.save` (its ``_COMPLETE`` marker written last): N steps are done.

Agreement between ranks: every manager step all-reduces one small flag tensor on a gloo group
of its own (stop requested? time-based save due?), so all ranks save at the same step; saves
run on a second gloo group, in DCP's background thread, so the training thread's own
collectives never interleave with them.

Memory snapshots: in a call with ``max_restarts``, the same state is also copied at step
boundaries into shared memory outside the ranks (`gangrun.rank.snapshots`), and a restore takes
the newest of memory and storage.

The parts (Lightning's split): this module decides when to save, what goes in, which
checkpoint to restore and which to keep; `gangrun.rank.checkpoint_io` writes and reads them
(through `gangrun.checkpoint.volume.write`, the one place a checkpoint is written); the
exactly-once metrics and the run's newest-checkpoint tag are the rank's tracking
(`gangrun.rank.step_metrics`).
"""

from __future__ import annotations

import math
import os
import re
import sys
import time
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

from ..checkpoint import integrity as _integrity
from ..checkpoint import is_complete, list_checkpoints, remove
from ..checkpoint import state as _state
from ..wire import contract
from ..wire.rundir import RunDir
from ..wire.stop import Stopped, write_stopped
from ..wire.tags import TAG_LATEST
from . import location, progress
from . import snapshots as _memory
from . import stop as _stop
from .checkpoint_io import CheckpointIO
from .step_metrics import StepMetrics, tag_latest

PREFIX = "step-"


def _dist() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


class Checkpointer:
    """Save and restore one state mapping of this rank (see the module docstring).

    Args:
        state: name -> object: modules, optimizers, LR schedulers, loaders, a DeepSpeed engine,
            anything with ``state_dict``/``load_state_dict``, plain values.
        every: save after every ``every`` steps (``None``: not by step count).
        every_seconds: save when this long has passed since the last save (rank 0's clock).
        keep: how many complete checkpoints to keep (``None``: all).
        dir: where (default: the call's ``checkpoint_dir``).
        async_save: write in the background (the step waits only for the copy of the state
            off the device). DeepSpeed engines are saved synchronously.
        storage_options: for fsspec (e.g. ``{"endpoint_url": ...}``).
    """

    def __init__(
        self,
        state: Mapping[str, Any] | None = None,
        *,
        every: int | None = None,
        every_seconds: float | None = None,
        keep: int | None = 3,
        dir: str | None = None,
        async_save: bool = True,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        root = dir if dir not in (None, "") else os.environ.get(contract.CHECKPOINT_DIR)
        if not root:
            raise RuntimeError(
                "Checkpointer: no checkpoint location. Name one for the call: "
                "@distributed(checkpoint_dir='s3://bucket/run') (or .options(...), the "
                f"--checkpoint-dir flag, {contract.CHECKPOINT_DIR_OPTION}), or Checkpointer(dir=...)."
            )
        _validate(state, every, every_seconds, keep, root, async_save, storage_options)
        self.dir = os.fspath(root).rstrip("/")
        self.every, self.every_seconds, self.keep = every, every_seconds, keep
        self.async_save = async_save
        self.storage_options = dict(storage_options or {})
        self._io = CheckpointIO(self.storage_options, async_save)  # the writes and reads
        self._step_metrics = StepMetrics()  # log_metrics' buffer: logged once the step is saved
        # a mapping the manager can put restored plain values into
        self.state: Mapping[str, Any] = (
            state if isinstance(state, MutableMapping) else dict(state or {})
        )
        self.step = 0  # steps done: the step to start from
        self.last: str | None = None  # newest committed checkpoint (this manager's view)
        self.restored_from: str | None = None
        self._entries: _state.Entries | None = None
        self._saved_step = -1
        self._last_save = time.monotonic()
        self._groups: tuple[Any, Any] | None = None
        self._rank, self._world = 0, 1
        self._restored = False
        self._mem: _memory.MemorySnapshots | None = None  # the call's memory snapshots
        _stop.install()
        location.claim(self.dir, self)  # a second live manager on this location: an error

    # ------------------------------------------------------------------ helpers
    def _setup(self) -> None:
        if self._groups is not None:
            return
        dist = _dist()
        if dist is None:
            rank, world = env_rank_world()
            if world > 1:
                raise RuntimeError(
                    f"Checkpointer on rank {rank} of {world}: torch.distributed is not "
                    "initialised, so every rank would save to and restore from the same files "
                    "(rank 1 would get rank 0's state back). Call "
                    "torch.distributed.init_process_group() before the Checkpointer's first "
                    "restore()/steps()/save(); for independent trainings on each rank give "
                    f"each its own location: Checkpointer(..., dir=f'{{root}}/rank-{rank}')."
                )
            self._groups = (None, None)
            self._mem = _memory.MemorySnapshots.from_env(rank, world)
            return
        self._rank, self._world = dist.get_rank(), dist.get_world_size()
        self._mem = _memory.MemorySnapshots.from_env(self._rank, self._world)
        # one group for the per-step flag (training thread), one for saves (DCP's thread)
        self._groups = (dist.new_group(backend="gloo"), dist.new_group(backend="gloo"))

    def _classify(self, fresh: bool = False) -> _state.Entries:
        """The state mapping sorted by how each entry is saved; ``fresh``: sorted again, as
        the mapping is now (a save takes every entry as it is at save time: a reassigned
        plain value, a key added since)."""
        if self._entries is None or fresh:
            self._entries = _state.classify(self.state, self._rank)
            if self._entries.engines and "://" in self.dir and not self.dir.startswith("file://"):
                raise ValueError(
                    f"Checkpointer on rank {self._rank}: a DeepSpeed engine saves through its own "
                    f"checkpoint API, to a local or shared directory; {self.dir!r} is not one."
                )
        return self._entries

    def _url(self, step: int) -> str:
        return f"{self.dir}/{PREFIX}{step:09d}"

    def _agree(self, *flags: int) -> list[int]:
        dist = _dist()
        if dist is None or self._world == 1:
            return list(flags)
        import torch

        t = torch.tensor(list(flags), dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._groups[0])  # type: ignore[index]
        return [int(v) for v in t.tolist()]

    # ------------------------------------------------------------------ restore
    def restore(self, state: Mapping[str, Any] | None = None) -> int:
        """Load the newest complete checkpoint into the state (every rank calls it); returns
        the step to start from (0 when there is none)."""
        if state is not None:
            self.state, self._entries = state, None
        self._setup()
        e = self._classify(fresh=True)
        # rank 0 picks the newest *valid* checkpoint (warns of damaged ones it skips), and
        # reads how many ranks saved it: another world size restores by the rule of state.py
        choice = _integrity.choose(self.dir, **self.storage_options) if self._rank == 0 else None
        saved = _state.saved_world_or_none(getattr(choice, "url", None), self.storage_options)
        dist = _dist()
        if dist is not None and self._world > 1:
            box: list[Any] = [choice, saved]
            dist.broadcast_object_list(box, src=0, group=self._groups[0])  # type: ignore[index]
            choice, saved = box
        none_valid: Exception | None = None
        try:
            found = _integrity.chosen(choice)  # raises rank 0's error (none valid) on every rank
        except Exception as exc:  # every checkpoint damaged: a memory snapshot may be newer
            if self._mem is None:
                raise
            found, none_valid = None, exc
        if self._mem is not None:  # on every rank alike (the same environment)
            tpl = lambda: _state.load_template(e, self._rank)  # noqa: E731  (read into, as DCP)
            chosen = _memory.choose(self._mem, _step_of(found), self._gather, tpl)
            if chosen is not None:
                self._restored = True
                return self._from_memory(e, found, *chosen)
        if none_valid is not None:
            raise none_valid
        self._restored = True
        if found is None:
            self.step = 0
            progress.report_fresh_start()  # not progress (docs/restarts.md)
            return 0
        _state.reshard_check(e, found, saved or self._world, self._world, self._rank)
        group = self._groups[1] if self._groups else None
        blob = self._io.read(e, found, self._rank, saved, group, self.state)
        self.step = self._saved_step = int(blob["step"])
        if saved and saved != self._world and self._rank == 0:  # said in the cell
            print(_state.resume_note(e, self.step, saved, self._world), file=sys.stderr)
        self.last = self.restored_from = found
        self._step_metrics.replay(blob.get("metrics", []))
        self._last_save = time.monotonic()
        progress.report_resumed(self.step, saved if saved and saved != self._world else None)
        return self.step

    def _gather(self, value: Any) -> list[Any]:
        dist = _dist()
        if dist is None or self._world == 1:
            return [value]
        out: list[Any] = [None] * self._world
        dist.all_gather_object(out, value, group=self._groups[0])  # type: ignore[index]
        return out

    def _from_memory(self, e: _state.Entries, found: str | None, step: int, sd: Any) -> int:
        blob = _state.apply(e, _state.encoded_blob(sd, self._rank), self._rank, self.state)
        self.step = int(blob["step"])
        # the storage checkpoint of this step, when there is one, needs no saving again
        self._saved_step = self.step if _step_of(found) == self.step else -1
        self.last, self.restored_from = found, f"memory:{PREFIX}{step:09d}"
        if self._rank == 0:
            newest = "none" if found is None else f"step {_step_of(found)}"
            print(
                f"gangrun: resumed step {self.step} from the memory snapshot (the newest "
                f"storage checkpoint: {newest}).",
                file=sys.stderr,
            )
        self._step_metrics.replay(blob.get("metrics", []))
        self._last_save = time.monotonic()
        progress.report_resumed(self.step, None)
        return self.step

    # ------------------------------------------------------------------ stepping
    def steps(self, total: int) -> Iterator[int]:
        """``range(start, total)`` with the bookkeeping of `step_done` after each step
        (restores first if `restore` was not called); waits for the last save at the
        end, saving the final step too."""
        if not self._restored:
            self.restore()
        try:
            for step in range(self.step, total):
                yield step
                self.step_done(step, total)
            if self._saved_step != self.step:
                self.save()
        except GeneratorExit:
            # the loop was left early (break, return): every metric given so far reaches the
            # run (a later resume does not log a step twice: see _log) and the save in flight
            # is committed; the step the loop was in is not saved
            self.close()
            raise
        self.close()

    def step_done(self, step: int, total: int | None = None) -> bool:
        """Step ``step`` (0-based) is done: report it, save when due, and on a preemption
        save and stop the rank (``SystemExit(0)``; the call raises
        `gangrun.DistributedPreemptedError`). Returns whether it saved."""
        self._setup()
        mem = self._mem
        if mem is not None:
            mem.step_began()
        self.step = int(step) + 1
        progress.report_step(self.step, total)
        self._poll()
        due_time = self.every_seconds is not None and (
            time.monotonic() - self._last_save >= self.every_seconds
        )
        snap = int(mem is not None and mem.due(self.step))
        stop, due_time_all, snap = self._agree(int(_stop.should_stop()), int(due_time), snap)
        if stop:
            self._preempted()
        if snap and mem is not None and mem.enabled:
            mem.take(self.step, self._snapshot_dict)
        saved = False
        if (self.every is not None and self.step % self.every == 0) or due_time_all:
            self.save()
            saved = True
        if mem is not None:
            mem.step_ended()
        return saved

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Log ``metrics`` for ``step`` to the call's MLflow run once the checkpoint that
        covers the step is committed: a step replayed after a restore is logged once, never
        twice, never lost."""
        rank = self._rank if self._groups is not None else env_rank_world()[0]
        if not self._step_metrics.add(rank, step, int(time.time() * 1000), metrics):
            return
        if self.every is None and self.every_seconds is None:
            self._step_metrics.flush(self.step + 1)

    # ------------------------------------------------------------------ saving
    def save(self, *, wait: bool = False) -> str:
        """Checkpoint the state at `step` now (every rank calls it)."""
        self._setup()
        e = self._classify(fresh=True)
        self.wait()
        step, url = self.step, self._url(self.step)
        sd = self._save_dict(e, step)
        group = self._groups[1] if self._groups else None
        if self._io.write(e, sd, url, step, group):
            self._committed(step, url)
        self._saved_step = step
        self._last_save = time.monotonic()
        if wait:
            self.wait()
        return url

    def _save_dict(self, e: _state.Entries, step: int, encode: Any = None) -> dict[str, Any]:
        extra = {"step": step, "metrics": self._step_metrics.before(step)}
        return _state.save_dict(e, self._rank, extra, encode)

    def _snapshot_dict(self) -> dict[str, Any]:
        e = self._classify(fresh=True)
        if e.engines:
            from ..checkpoint.snapshots import Unsupported

            raise Unsupported("a DeepSpeed engine, saved through its own checkpoint API")
        return self._save_dict(e, self.step, encode=dict)  # the blob flattened, not torch.save'd

    def _poll(self) -> None:
        if self._io.done():
            self.wait()

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed."""
        written = self._io.wait()
        if written is not None:
            self._committed(*written)

    def _committed(self, step: int, url: str) -> None:
        self.last = url
        self._step_metrics.flush(step)
        if self._rank != 0:
            return
        tag_latest(url)
        if self.keep is not None:
            for old in list_checkpoints(self.dir, **self.storage_options)[: -self.keep]:
                remove(old, **self.storage_options)

    def _preempted(self) -> None:
        if self._saved_step != self.step:
            self.save(wait=True)
        else:
            self.wait()
        rd = os.environ.get(contract.RUN_DIR)
        if rd:
            record = Stopped(self.step, self.last, time.time(), os.environ.get("MLFLOW_RUN_ID"))
            write_stopped(RunDir(rd), self._rank, record)
        print(
            f"gangrun: rank {self._rank} checkpointed step {self.step} to {self.last} and stops "
            "(preempted).",
            file=sys.stderr,
        )
        raise SystemExit(0)

    def close(self) -> None:
        """Wait for the save in flight, log the metrics still buffered, free the staging
        copy of the state."""
        self.wait()
        self._step_metrics.flush(None)
        self._io.close()
        if self._mem is not None:
            self._mem.close()
        location.release(self.dir, self)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()


def _step_of(url: str | None) -> int | None:
    """The step of checkpoint ``url`` (its name's number), None for none."""
    m = re.search(r"(\d+)/*$", url or "")
    return int(m.group(1)) if m else None


def env_rank_world() -> tuple[int, int]:
    """``(RANK, WORLD_SIZE)`` of this process's environment (0 and 1 when unset)."""
    try:
        return int(os.environ.get("RANK") or 0), int(os.environ.get("WORLD_SIZE") or 1)
    except ValueError:
        return 0, 1


def _validate(
    state: Any,
    every: Any,
    every_seconds: Any,
    keep: Any,
    root: Any,
    async_save: Any,
    storage_options: Any,
) -> None:
    """A ``ValueError``/``TypeError`` naming the argument, for one the manager cannot use."""
    rank = env_rank_world()[0]
    where = f"Checkpointer on rank {rank}"
    for name, v in (("every", every), ("keep", keep)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{where}: {name} must be an integer >= 1 or None, got {v!r}")
    if every_seconds is not None:
        if isinstance(every_seconds, bool) or not isinstance(every_seconds, (int, float)):
            raise TypeError(
                f"{where}: every_seconds must be a number of seconds > 0 or None, got "
                f"{every_seconds!r} ({type(every_seconds).__name__})"
            )
        if not every_seconds > 0 or every_seconds != every_seconds or every_seconds == math.inf:
            raise ValueError(
                f"{where}: every_seconds must be a number of seconds > 0 or None, got "
                f"{every_seconds!r}"
            )
    if not isinstance(root, (str, os.PathLike)):
        raise TypeError(f"{where}: dir must be a path or URL string, got {type(root).__name__}")
    if not isinstance(async_save, bool):
        raise TypeError(f"{where}: async_save must be True or False, got {async_save!r}")
    if storage_options is not None and not isinstance(storage_options, Mapping):
        raise TypeError(
            f"{where}: storage_options must be a dict of fsspec options, got "
            f"{type(storage_options).__name__}"
        )
    if state is not None and not isinstance(state, Mapping):
        raise TypeError(
            f"{where}: the state must be a dict of name -> object (model, optimizer, loader, "
            f"plain values), got {type(state).__name__}"
        )


def should_stop() -> bool:
    """See `gangrun.rank.stop.should_stop`."""
    return _stop.should_stop()


__all__ = ["Checkpointer", "should_stop", "is_complete", "PREFIX", "TAG_LATEST"]
