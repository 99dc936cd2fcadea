"""[`VolumeDataset`][gangrun.data.VolumeDataset]: an ``IterableDataset`` over the files of any storage, sharded
across ranks and DataLoader workers, cached, shuffled per epoch and resumable mid-epoch.

The guarantees are listed in `gangrun.data`; the pieces it is built from live in
`listing` (what files), `sharding` (who reads which), `cache` (local copies of
remote files) and `prefetch` (reading ahead).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal

from torch.utils.data import IterableDataset

from . import elastic, lanes, sharding, split
from .cache import FileCache, parse_size
from .listing import LOCAL_PROTOCOLS, FileEntry, list_files, read_local
from .prefetch import Progress, stream
from .read_errors import DataReadError, place, read_error
from .resumable import ResumableEpochs
from .split import Position

if TYPE_CHECKING:
    from .loader import VolumeLoader


class VolumeDataset(ResumableEpochs, IterableDataset):
    """An iterable dataset over the files under ``source`` (see the module docstring).

    Args:
        source: local directory or file, glob (``"data/*.pt"``), fsspec URL (``"s3://b/p/"``,
            ``"memory://x"``, ...) or a list of them on one filesystem.
        decode: ``decode(data: bytes)`` -> one sample, or an *iterator* (e.g. a generator or
            ``iter(list)``) of samples. Lists, tuples, tensors, dicts are one sample each.
            Default: the file's bytes are the sample.
        shuffle: shuffle the file order every epoch (same permutation on every rank).
        seed: seed of the shuffle; epoch ``e`` uses ``(seed, e)``.
        cache_dir: where remote files are cached (default `default_cache_dir`).
        cache_limit: cache size bound in bytes (or ``"20GB"``); default half the free space.
        cache: ``"auto"`` (default: cache everything that is not on the local filesystem),
            ``True`` or ``False``.
        uneven: ``"pad"`` (default; repeat files from the start of the epoch's order so every
            rank gets ``ceil(n / world_size)`` files and none is skipped) or ``"drop"`` (every
            rank gets ``n // world_size`` files; the rest of the epoch's order is not read).
        samples_per_rank: yield exactly this many samples per rank and epoch (split across
            workers), cycling over the rank's files if they hold fewer. Use it when files
            decode to different numbers of samples.
        prefetch: files read ahead by a background thread in each worker (default: 4 for
            remote, 0 for local files).
        rank, world_size: override ``RANK``/``WORLD_SIZE`` (otherwise from the environment
            that gangrun or torchrun sets; 0 and 1 when neither is set; one without the other
            is an error).
        storage_options: passed to fsspec (e.g. ``{"endpoint_url": ...}`` for s3).
        global_batch_size: hold the global batch: the loader's batches are each rank's share
            (``global_batch_size // world_size`` samples) of global batch ``k``, the same set
            of samples on every world size that divides ``lanes``, and a resume on another
            size continues at the global batch where the world stopped (`gangrun.data.lanes`).
            Each file is one sample. Default: each rank reads its own share of the epoch.
        lanes: the epoch's canonical lanes with ``global_batch_size`` (default: the global
            batch size); fixed for a run: the world sizes it can run on divide it.
    """

    def __init__(
        self,
        source: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        *,
        decode: Callable[[bytes], Any] | None = None,
        shuffle: bool = False,
        seed: int = 0,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit: int | str | None = None,
        cache: bool | Literal["auto"] = "auto",
        uneven: Literal["pad", "drop"] = "pad",
        samples_per_rank: int | None = None,
        prefetch: int | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        storage_options: dict[str, Any] | None = None,
        global_batch_size: int | None = None,
        lanes: int | None = None,
    ) -> None:
        super().__init__()
        if uneven not in ("pad", "drop"):
            raise ValueError(f"uneven must be 'pad' or 'drop', got {uneven!r}")
        if samples_per_rank is not None and samples_per_rank < 0:
            raise ValueError("samples_per_rank must be >= 0")
        self.source = source
        self.decode = decode
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.uneven = uneven
        self.samples_per_rank = samples_per_rank
        self.storage_options = dict(storage_options or {})
        self._rank = rank
        self._world_size = world_size
        self.protocol, self.files, _ = list_files(source, self.storage_options)
        remote = self.protocol not in LOCAL_PROTOCOLS
        self.cached = remote if cache == "auto" else bool(cache)
        self.prefetch = (4 if remote else 0) if prefetch is None else int(prefetch)
        self._cache_dir = os.fspath(cache_dir) if cache_dir is not None else None
        self._cache_limit = parse_size(cache_limit)
        self._cache: FileCache | None = None
        self._cache_pid = -1
        self._fs: Any = None
        self._fs_pid = -1
        self._keys: dict[str, str] = {}
        self._epoch = 0
        self._resume: split.Position | None = None  # applied once, by the next iteration
        self._live: split.Position | None = None  # progress of the current/last iteration
        self.rank_world()  # RANK without WORLD_SIZE: an error now, not a rank reading it all
        if global_batch_size is not None and samples_per_rank is not None:
            raise ValueError(
                "VolumeDataset: global_batch_size and samples_per_rank exclude each other (a "
                "held global batch counts the epoch's files, a quota counts each rank's samples)"
            )
        self._held_init(global_batch_size, lanes, per_item=True)

    # -- partitioning --------------------------------------------------------------------------

    def rank_world(self) -> tuple[int, int]:
        """``(rank, world_size)`` this dataset shards for (arguments, else the environment)."""
        return split.rank_world(self._rank, self._world_size, "VolumeDataset")

    def epoch_order(self, epoch: int | None = None) -> list[int]:
        """Indexes into `files` in the order of ``epoch`` (same on every rank)."""
        e = self._epoch if epoch is None else epoch
        return sharding.epoch_order(len(self.files), self.shuffle, self.seed, e)

    def rank_files(self, epoch: int | None = None, rank: int | None = None) -> list[FileEntry]:
        """The files rank ``rank`` reads in ``epoch`` (padded or dropped to equal counts)."""
        r, world = self.rank_world()
        r = r if rank is None else rank
        share = sharding.rank_share(self.epoch_order(epoch), r, world, self.uneven)
        return [self.files[i] for i in share]

    def __len__(self) -> int:
        """Samples per rank and epoch: ``samples_per_rank``, else files per rank (exact when
        every file decodes to one sample)."""
        if self.samples_per_rank is not None:
            return self.samples_per_rank
        if self.held is not None:
            return self.lane_layout().batches * self.held["global_batch"] // self.rank_world()[1]
        return len(self.rank_files())

    def _items(self) -> int:
        return len(self.files)

    # -- reading -------------------------------------------------------------------------------

    def _filesystem(self) -> Any:
        if self._fs is None or self._fs_pid != os.getpid():
            import fsspec

            self._fs = fsspec.filesystem(self.protocol, **self.storage_options)
            self._fs_pid = os.getpid()
        return self._fs

    def _file_cache(self) -> FileCache:
        if self._cache is None or self._cache_pid != os.getpid():
            self._cache = FileCache(self._cache_dir, self._cache_limit)
            self._cache_pid = os.getpid()
        return self._cache

    @property
    def cache(self) -> FileCache | None:
        """This process's view of the cache (``None`` when files are not cached)."""
        return self._file_cache() if self.cached else None

    def _key(self, entry: FileEntry) -> str:
        key = self._keys.get(entry.path)
        if key is None:
            key = self._keys[entry.path] = FileCache.key(
                self.protocol, entry.path, entry.size, entry.version
            )
        return key

    def read(self, entry: FileEntry) -> bytes:
        """The bytes of one listed file (through the cache for remote files)."""
        if self.protocol in LOCAL_PROTOCOLS and not self.cached:
            return read_local(entry)
        fs = self._filesystem()
        if not self.cached:
            return bytes(fs.cat_file(entry.path))
        return self._file_cache().get(
            self._key(entry), lambda: bytes(fs.cat_file(entry.path)), entry.size
        )

    def _hit_reader(self) -> Callable[[FileEntry], bytes | None] | None:
        """``f(entry)`` -> the bytes if they are at hand (local file or cache hit), else None;
        None when nothing is ever at hand (uncached remote files)."""
        if not self.cached:
            return read_local if self.protocol in LOCAL_PROTOCOLS else None
        cache = self._file_cache()
        read_entry = cache.read_entry
        key = self._key

        def hit(entry: FileEntry) -> bytes | None:
            data = read_entry(key(entry), entry.size)
            if data is not None:
                cache.hits += 1
            return data

        return hit

    def _stream(
        self,
        files: list[FileEntry],
        quota: int | None,
        start: Sequence[int] | None,
        skips: list[int] | None = None,
    ) -> Iterator[tuple[Any, Progress]]:
        """(sample, progress) pairs; progress = (file position, samples of it done, yielded)."""
        if not files:  # nothing to read: no cache or filesystem to set up
            return stream(files, quota, start, read=self.read, hit=None, decode=None, prefetch=0)
        hit = self._hit_reader()
        return stream(
            files,
            quota,
            start,
            read=self.read,
            hit=hit,
            decode=self.decode,
            prefetch=0 if hit is read_local else self.prefetch,
            skips=skips,
            on_error=self._read_error,
        )

    def _read_error(self, entry: FileEntry, stage: str, error: Exception) -> BaseException | None:
        """The error to raise for ``error`` reading (or decoding) ``entry``: it names the
        file, the rank and the DataLoader worker (the original error chained)."""
        if isinstance(error, DataReadError):
            return None
        copy = None
        if self.cached and self.protocol not in LOCAL_PROTOCOLS:
            copy = self._file_cache().path(self._key(entry))
        if stage == "decode":
            name = getattr(self.decode, "__qualname__", None) or repr(self.decode)
            return read_error(
                "VolumeDataset",
                [f"{place(entry.path, copy=copy)} (decode={name})"],
                error,
                self.rank_world()[0],
                doing="could not decode",
                hint="The file is damaged or not what decode expects: check it, rewrite or "
                "remove it (or fix decode), and run again.",
            )
        return read_error("VolumeDataset", [place(entry.path)], error, self.rank_world()[0])

    def _iterate(self, start: Position | None, tagged: bool) -> Iterator[Any]:
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        if self.held is not None:
            yield from self._iterate_held(start, tagged, wid, nw, info is None and not tagged)
            return
        rank, _ = self.rank_world()
        start = self._plan(start, nw, warn=info is None or info.id == 0)
        wid = self._logical_worker(wid, nw, start)
        skips: list[int] | None = None
        if start is not None and start.get("base") is not None:  # the rest of an epoch
            run = elastic.file_runs(
                start, rank, len(self.files), self.shuffle, self.seed, self.uneven
            )[wid]
            files, quota = [self.files[f] for f, _ in run], None
            skips = [k for _, k in run]
        else:
            files, quota = sharding.worker_plan(
                self.rank_files(rank=rank), wid, nw, self.samples_per_rank
            )
        wstart = start["workers"][wid] if start is not None else None
        track = info is None and not tagged  # direct iteration in this process
        if track:
            self.start_progress(1, start)
        yield from self._deliver(self._stream(files, quota, wstart, skips), wid, tagged, track)

    def _iterate_held(
        self, start: Position | None, tagged: bool, wid: int, nw: int, track: bool
    ) -> Iterator[Any]:
        """The global batch held: this worker's part of each global batch from the one the
        position names (tagged: a list of samples per batch, ``None`` for a worker without
        lanes), or, iterated directly, the samples one by one."""
        lay, mine, first = self.held_worker(start, wid, nw)
        order = self.epoch_order()
        files = [self.files[order[p]] for p in lanes.run(lay, mine, first)]
        per = len(mine) * lay.part
        if track:
            self.start_progress(1, start)
        samples = self._stream(files, None, None)
        for k in range(first, lay.batches):
            part = []
            for _ in range(per):
                got = next(samples, None)
                if got is None or got[1][1] or got[1][0] != got[1][2]:
                    at = files[min(got[1][0], len(files) - 1) if got else -1].path
                    raise ValueError(
                        f"VolumeDataset with global_batch_size on rank {self.rank_world()[0]}: "
                        f"the files up to {at} did not decode to exactly one sample each; a "
                        "held global batch counts one sample per file. Make decode return one "
                        "sample per file, or leave global_batch_size unset."
                    )
                part.append(got[0])
            if tagged:
                yield (part if per else None), (wid, k + 1)
                continue
            for i, sample in enumerate(part):
                if track and i == len(part) - 1:
                    self.record_progress(0, k + 1)
                yield sample

    def _plan(self, start: Position | None, nw: int, warn: bool) -> Position | None:
        """The record a pass of ``nw`` workers starts from: ``start`` on the same layout, the
        rest of the epoch on another (`elastic`), or ``None`` (a fresh epoch)."""
        if self.held is not None:  # the global batch index: the same on any layout
            return start
        _, world = self.rank_world()

        def same(s: Position) -> bool:
            return split.same_layout(s, world, nw)

        if self.samples_per_rank is not None:  # a quota per rank: no rest to continue
            if start is None or ("merged" not in start and same(start)):
                return start
            if warn:
                warnings.warn(
                    f"VolumeDataset: the saved position was made with world_size="
                    f"{start.get('world_size')} and {start.get('num_workers')} worker(s), not "
                    f"{world} and {nw}, and samples_per_rank is set (a quota per rank); epoch "
                    f"{self._epoch} restarts from its beginning.",
                    stacklevel=4,
                )
            return None
        return self._planned(
            start,
            nw,
            same,
            lambda: split.position(self._epoch, world, nw, self.seed, files=len(self.files)),
            warn,
        )

    # -- resumable state -----------------------------------------------------------------------
    #
    # A position is a JSON-able dict: {"epoch", "world_size", "num_workers", "files", "seed",
    # "workers": [progress of each DataLoader worker, or None]}, where a worker's progress is
    # [file position in its plan, samples of that file done, samples yielded in all]. Direct
    # iteration keeps it up to date itself; a loader that runs the dataset in worker processes
    # uses the four public methods below (see VolumeLoader).

    def resume_position(self) -> Position | None:
        """Take the position restored by `load_state_dict`, once: the pass that starts
        now continues from it. ``None`` when nothing was restored, or (with a warning) when it
        does not match this dataset's epoch or file count, so the epoch restarts."""
        start, self._resume = self._resume, None
        if start is None:
            return None
        if start.get("epoch") != self._epoch or start.get("files") != len(self.files):
            warnings.warn(
                "VolumeDataset: the saved position does not match this dataset (epoch or file "
                "count changed); the epoch restarts from its beginning.",
                stacklevel=3,
            )
            return None
        return start if self._held_matches(start) else None

    def _rest_size(self, base: dict[str, Any]) -> tuple[int, int, str]:
        n = len(self.files)
        rest = elastic.rest_files(base, n, self.shuffle, self.seed, self.uneven)
        return len(rest), n, "files"

    def start_progress(self, num_workers: int, start: Position | None = None) -> None:
        """Begin recording a pass read by ``num_workers`` workers (1: in this process), from
        position ``start`` (on another world size or worker count: the rest of its epoch,
        `elastic`). `state_dict` reports this pass from now on."""
        _, world = self.rank_world()
        nw = max(1, int(num_workers))
        if self.held is not None:
            self._live = self._held_record(nw, start, files=len(self.files))
            return
        planned = self._plan(start, nw, warn=False)
        if planned is not None and planned.get("base") is not None:  # the rest, computed once
            rank = self.rank_world()[0]  # here: workers forked after this inherit it
            elastic.file_runs(planned, rank, len(self.files), self.shuffle, self.seed, self.uneven)
        self._live = (
            split.copied(planned)
            if planned is not None
            else split.position(self._epoch, world, nw, self.seed, files=len(self.files))
        )

    # -- DataLoader ----------------------------------------------------------------------------

    def loader(self, **dataloader_kwargs: Any) -> VolumeLoader:
        """A ``DataLoader`` over this dataset that keeps `state_dict` exact with workers
        (they are kept across epochs unless ``persistent_workers=False``)."""
        from .loader import VolumeLoader, keep_workers_by_default

        return VolumeLoader(self, **keep_workers_by_default(dataloader_kwargs))

    def __repr__(self) -> str:
        return (
            f"VolumeDataset({self.source!r}, files={len(self.files)}, shuffle={self.shuffle}, "
            f"uneven={self.uneven!r}, cached={self.cached})"
        )


__all__ = ["VolumeDataset"]
