"""Checkpoint manifests: what recording and verifying them costs.

    PYTHONPATH=src python bench/bench_manifest.py --reps 7      # BENCH_MANIFEST_MB=100 (default)

One process (no process group), ``BENCH_MANIFEST_MB`` MB of float32 tensors (10 of them), on
local disk under the temp directory, with fsync as a checkpoint's save does. Per repetition,
in alternating order:

* ``torch_fsspec``: ``torch.distributed.checkpoint.save`` with torch's own ``FsspecWriter``
  (no commit marker, no manifest);
* ``gangrun``: `gangrun.checkpoint.save` (``VolumeWriter``: each file's size and CRC-32
  computed as it is written, the directory listed once, the marker with the manifest);
* ``gangrun_no_manifest``: the same save with the manifest's two steps (the tap on the
  streams, the listing at commit) replaced by no-ops: the marker as before manifests;
* ``verify``: `gangrun.checkpoint.verify` (one listing, sizes compared), what a restore does;
* ``verify_checksums``: ``verify(checksums=True)`` (every byte read back and its CRC-32).

Ratios: gangrun / gangrun_no_manifest (what the manifest costs), gangrun / torch_fsspec.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import warnings

from _common import interleaved, main, report


def run(reps: int) -> dict:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    from gangrun import checkpoint

    mb = float(os.environ.get("BENCH_MANIFEST_MB", "100"))
    n = int(mb * 1e6 / 4 / 10)
    state = {f"t{i}": torch.randn(n) for i in range(10)}
    where = tempfile.mkdtemp(prefix="bench-manifest-")
    count = iter(range(10**9))

    def plain() -> float:
        url = os.path.join(where, f"plain-{next(count)}")
        t = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state, storage_writer=FsspecWriter(url, sync_files=True), no_dist=True)
        took = time.perf_counter() - t
        shutil.rmtree(url)
        return took

    last = {}

    def ours() -> float:
        url = os.path.join(where, f"ours-{next(count)}")
        t = time.perf_counter()
        checkpoint.save(state, url)
        took = time.perf_counter() - t
        if "url" in last:
            shutil.rmtree(last["url"])
        last["url"] = url
        return took

    from gangrun.checkpoint import manifest

    tap, build = manifest.tap_streams, manifest.build_manifest

    def without() -> float:
        manifest.tap_streams = lambda *a: None  # type: ignore[assignment]
        manifest.build_manifest = lambda *a: {}  # type: ignore[assignment]
        try:
            url = os.path.join(where, f"bare-{next(count)}")
            t = time.perf_counter()
            checkpoint.save(state, url)
            took = time.perf_counter() - t
            shutil.rmtree(url)
            return took
        finally:
            manifest.tap_streams, manifest.build_manifest = tap, build

    def sizes() -> float:
        t = time.perf_counter()
        assert checkpoint.verify(last["url"]).ok
        return time.perf_counter() - t

    def crcs() -> float:
        t = time.perf_counter()
        assert checkpoint.verify(last["url"], checksums=True).ok
        return time.perf_counter() - t

    try:
        ours()  # warm-up, and a checkpoint to verify
        plain()
        times = interleaved(
            reps,
            {
                "torch_fsspec": plain,
                "gangrun_no_manifest": without,
                "gangrun": ours,
                "verify": sizes,
                "verify_checksums": crcs,
            },
        )
    finally:
        shutil.rmtree(where, ignore_errors=True)
    res = report(
        "checkpoint_manifest",
        times,
        {
            "manifest_overhead": ("gangrun", "gangrun_no_manifest"),
            "vs_torch_fsspec": ("gangrun", "torch_fsspec"),
        },
    )
    res["megabytes"] = mb
    return res


if __name__ == "__main__":
    main(run, default_reps=7)
