"""(9) TableDataset: rows/s of a 2-rank x 2-worker epoch over the same Parquet files against

(a) one process scanning them with ``pyarrow.dataset`` (the reading cost per row; target:
    the 2x2 epoch's aggregated rows/s >= 0.9x the scan's),
(b) Hugging Face ``datasets`` streaming them with ``split_dataset_by_node`` (2 ranks x 2
    DataLoader workers too): batches as dicts of tensors (``with_format("numpy").batch``),
    and its fastest path, Arrow batches, against TableDataset's ``output="arrow"``,
and, for reference, 2 ranks reading without DataLoader workers (the reading cost itself,
without the worker hand-over);
(c) the same epoch from a loopback S3 server (moto, in its own process): cold node cache
    (emptied before each epoch) against warm.

    PYTHONPATH=src python bench/bench_tables.py --reps 5 [--rows 2000000 --files 8]
        [--only local]   # (a) and the 2-rank runs only: no HF datasets, no S3

An epoch is timed inside the ranks, from the loader's first batch request to its last batch;
both ranks start each epoch together (gloo barrier) and the slower rank's time counts. Runs
interleave per repetition. Each TableDataset run reads ``EPOCHS`` epochs of one dataset
through one ``ds.loader(num_workers=2)`` (workers kept across epochs, its default) and the
last epoch is timed; the first also starts the workers and makes the shared memory blocks
of their hand-over (``gangrun_2x2_torch_first_epoch_s``). ``gangrun_2x2_torch_fresh_workers``
is the same with ``persistent_workers=False`` and a loader per epoch: workers forked every
epoch. Hugging Face's loader keeps its workers across epochs too (``datasets`` shares the
epoch with persistent workers).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import table_ranks
from _common import free_port, median, ratio, start_moto, summary

BATCH = 4096
WORKERS = 2
#: TableDataset epochs per run; the last one is timed (the first also makes the dataset's
#: shared memory blocks for its workers' hand-over: once per dataset, reported apart)
EPOCHS = 2


def _write(root: str, rows: int, files: int) -> list[str]:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(root, exist_ok=True)
    rng = np.random.default_rng(0)
    per = rows // files
    paths = []
    for k in range(files):
        n = per if k < files - 1 else rows - per * (files - 1)
        t = pa.table(
            {
                "id": np.arange(k * per, k * per + n),
                "x": rng.random(n, dtype=np.float32),
                "y": rng.random(n),
                "label": rng.integers(0, 1000, n, dtype=np.int32),
                "emb": pa.FixedSizeListArray.from_arrays(rng.random(n * 8, dtype=np.float32), 8),
            }
        )
        path = os.path.join(root, f"part-{k:03d}.parquet")
        pq.write_table(t, path, row_group_size=65536)
        paths.append(path)
    return paths


def _scan(paths: list[str]) -> tuple[float, float]:
    """(wall, CPU) seconds of one process scanning the files with pyarrow.dataset."""
    import pyarrow.dataset as pds

    t, c = time.perf_counter(), table_ranks.cpu_seconds()
    n = sum(b.num_rows for b in pds.dataset(paths, format="parquet").to_batches(batch_size=BATCH))
    dt = time.perf_counter() - t
    assert n > 0
    return dt, table_ranks.cpu_seconds() - c


def _slowest(out: list[dict], cpu: dict[str, list[float]], key: str) -> float:
    """The slower rank's epoch seconds; notes the CPU seconds of both ranks (and workers)."""
    cpu.setdefault(key, []).append(sum(r["cpu"][-1] for r in out))
    return max(r["times"][-1] for r in out)


def run(reps: int, rows: int = 2_000_000, files: int = 8, only: str = "all") -> dict:
    from gangrun import distributed

    work = tempfile.mkdtemp(prefix="bench-tables-")
    server = None
    try:
        local = os.path.join(work, "local")
        paths = _write(local, rows, files)
        nbytes = sum(os.path.getsize(p) for p in paths)
        env = {
            "HF_HOME": os.path.join(work, "hf"),
            "HF_DATASETS_OFFLINE": "1",
            "HF_HUB_OFFLINE": "1",
            "AWS_ACCESS_KEY_ID": "bench",
            "AWS_SECRET_ACCESS_KEY": "bench",
        }
        gang = distributed(processes=2, mlflow=False, timeout=900, output="none", env=env)
        table = gang(table_ranks.table_epochs)
        hf = gang(table_ranks.hf_epochs)
        cache = os.path.join(work, "cache")

        # warm-up (page cache, fork server, imports), untimed
        _scan(paths)
        table.distributed(local, {}, cache, WORKERS, BATCH, "torch", 1, False)
        full = only == "all"
        opts: dict[str, str] = {}
        s3 = ""
        if full:
            port = free_port()
            os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench")
            server = start_moto(port)
            import s3fs

            opts = {"endpoint_url": f"http://127.0.0.1:{port}", "key": "bench", "secret": "bench"}
            fs = s3fs.S3FileSystem(**opts)
            fs.mkdir("bench-tables")
            fs.put(local + "/", "bench-tables/t/", recursive=True)
            s3 = "s3://bench-tables/t/"
            hf.distributed(paths, WORKERS, BATCH, 1, "arrow")
        t: dict[str, list[float]] = {
            k: []
            for k in (
                "pyarrow_dataset_scan_1proc",
                "gangrun_2x2_torch",
                "gangrun_2x2_torch_fresh_workers",
                "gangrun_2x2_arrow",
                "gangrun_2x0_torch",
                "hf_streaming_2x2_torch",
                "hf_streaming_2x2_arrow",
                "s3_cold_2x2_torch",
                "s3_warm_2x2_torch",
            )
        }
        setup: dict[str, float] = {}
        first: list[float] = []  # 2x2 torch: the first epoch of each run
        cpu: dict[str, list[float]] = {}
        for _ in range(reps):
            wall, c = _scan(paths)
            t["pyarrow_dataset_scan_1proc"].append(wall)
            cpu.setdefault("pyarrow_dataset_scan_1proc", []).append(c)
            out = table.distributed(local, {}, cache, WORKERS, BATCH, "torch", EPOCHS, False)
            assert sum(r["rows"] for r in out) == rows
            t["gangrun_2x2_torch"].append(_slowest(out, cpu, "gangrun_2x2_torch"))
            setup["gangrun_local"] = max(r["setup"] for r in out)
            first.append(max(r["times"][0] for r in out))
            out = table.distributed(local, {}, cache, WORKERS, BATCH, "torch", EPOCHS, False, False)
            key = "gangrun_2x2_torch_fresh_workers"
            t[key].append(_slowest(out, cpu, key))
            out = table.distributed(local, {}, cache, WORKERS, BATCH, "arrow", EPOCHS, False)
            t["gangrun_2x2_arrow"].append(_slowest(out, cpu, "gangrun_2x2_arrow"))
            out = table.distributed(local, {}, cache, 0, BATCH, "torch", EPOCHS, False)
            t["gangrun_2x0_torch"].append(_slowest(out, cpu, "gangrun_2x0_torch"))
            if not full:
                continue
            for fmt in ("numpy", "arrow"):
                out = hf.distributed(paths, WORKERS, BATCH, 1, fmt)
                assert sum(r["rows"] for r in out) == rows, out
                key = "torch" if fmt == "numpy" else fmt
                t[f"hf_streaming_2x2_{key}"].append(_slowest(out, cpu, f"hf_streaming_2x2_{key}"))
            setup["hf"] = max(r["setup"] for r in out)
            out = table.distributed(s3, opts, cache, WORKERS, BATCH, "torch", EPOCHS, True)
            t["s3_cold_2x2_torch"].append(_slowest(out, cpu, "s3_cold_2x2_torch"))
            setup["gangrun_s3"] = max(r["setup"] for r in out)
            out = table.distributed(s3, opts, cache, WORKERS, BATCH, "torch", EPOCHS, False)
            t["s3_warm_2x2_torch"].append(_slowest(out, cpu, "s3_warm_2x2_torch"))
        t = {k: v for k, v in t.items() if v}
        med = {k: median(v) for k, v in t.items()}
        scan = "pyarrow_dataset_scan_1proc"

        def vs(a: str, b: str) -> float:
            """``b``'s rows/s over ``a``'s (medians), nan when one was not run."""
            return ratio(med[a], med[b]) if a in med and b in med else float("nan")

        return {
            "name": "tables",
            "unit": "s",
            "rows": rows,
            "files": files,
            "mbytes": round(nbytes / 1e6, 1),
            "loadavg": round(os.getloadavg()[0], 1),
            "rows_per_s": {k: round(rows / v) for k, v in med.items()},
            "setup_s": {k: round(v, 3) for k, v in setup.items()},
            "gangrun_2x2_torch_first_epoch_s": round(median(first), 3),
            # CPU seconds per epoch, all processes (ranks and their DataLoader workers)
            "cpu_s": {k: round(median(v), 3) for k, v in cpu.items()},
            # the same per row, in nanoseconds
            "cpu_ns_per_row": {k: round(median(v) / rows * 1e9) for k, v in cpu.items()},
            "results": {k: summary(v) for k, v in t.items()},
            "ratios": {
                "gangrun_vs_pyarrow_dataset": vs(scan, "gangrun_2x2_torch"),
                # the median of the ratios of each repetition (scan and 2x2 ran back to back)
                "gangrun_vs_pyarrow_dataset_per_rep": median(
                    [a / b for a, b in zip(t[scan], t["gangrun_2x2_torch"], strict=True)]
                ),
                "gangrun_fresh_workers_vs_pyarrow_dataset": vs(
                    scan, "gangrun_2x2_torch_fresh_workers"
                ),
                "gangrun_2x0_vs_pyarrow_dataset": vs(scan, "gangrun_2x0_torch"),
                "gangrun_arrow_vs_pyarrow_dataset": vs(scan, "gangrun_2x2_arrow"),
                "gangrun_vs_hf_streaming": vs("hf_streaming_2x2_torch", "gangrun_2x2_torch"),
                "gangrun_arrow_vs_hf_streaming_arrow": vs(
                    "hf_streaming_2x2_arrow", "gangrun_2x2_arrow"
                ),
                "s3_warm_vs_cold": vs("s3_cold_2x2_torch", "s3_warm_2x2_torch"),
                "cpu_gangrun_2x2_over_pyarrow_dataset": ratio(
                    median(cpu["gangrun_2x2_torch"]), median(cpu[scan])
                ),
                "cpu_gangrun_2x0_over_pyarrow_dataset": ratio(
                    median(cpu["gangrun_2x0_torch"]), median(cpu[scan])
                ),
            },
        }
    finally:
        if server is not None:
            server.kill()
            server.wait(10)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    import argparse
    import json

    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--only", choices=["all", "local"], default="all")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    res = run(max(1, a.reps), a.rows, a.files, a.only)
    text = json.dumps(res, indent=2)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(text, flush=True)
