"""The rest of an epoch on another number of ranks: its throughput against a
fresh epoch's, 2 ranks x 2 DataLoader workers, files (`VolumeDataset`) and tables
(`TableDataset`).

A fresh epoch is read in the per-rank order (each rank's share a slice of the epoch's one
order, shuffled by the seed and the epoch alone). The rest of an epoch saved by 3 ranks at
``--cut`` of it is the same order's remaining items, laid out for the 2 ranks
(`gangrun.data.elastic`): a table's rows are taken from row groups read whole (a row group
the saved world half read is read again), files are read with the samples already read
skipped. The figure: rows (samples) per second of the rest pass over the fresh epoch's
(target >= 0.95: the global order costs at most 5%).

``--held``: whole epochs with the global batch held (``global_batch_size=``, the epoch cut
into lanes, `gangrun.data.lanes`) against today's per-rank order, batches of the same size
(4096 rows, 64 files per rank), 2 ranks x 2 workers, the default lanes and a lane per worker;
the figure: samples per second held over per-rank (target >= 0.95).

    PYTHONPATH=src python bench/bench_elastic.py --reps 3 [--rows 2000000 --files 4000]
    PYTHONPATH=src python bench/bench_elastic.py --held --reps 5 [--rows 2000000 --files 4000]
"""

from __future__ import annotations

import os
import shutil
import tempfile

import elastic_ranks
from _common import median, ratio, summary

WORKERS = 2


def _files(root: str, n: int) -> None:
    import numpy as np

    os.makedirs(root, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        with open(os.path.join(root, f"s{i:06d}.bin"), "wb") as f:
            f.write(rng.bytes(4096))


def run(reps: int, rows: int = 2_000_000, files: int = 4000, cut: float = 0.3) -> dict:
    import bench_tables

    from gangrun import distributed

    work = tempfile.mkdtemp(prefix="bench-elastic-")
    try:
        table = os.path.join(work, "table")
        bench_tables._write(table, rows, 8)
        vol = os.path.join(work, "files")
        _files(vol, files)
        gang = distributed(processes=2, mlflow=False, timeout=900, output="none")
        fn = gang(elastic_ranks.rest_of_epoch)
        fn.distributed("table", table, WORKERS, 3, cut)  # warm-up: page cache, fork server
        t: dict[str, list[float]] = {}
        n: dict[str, int] = {}
        for _ in range(reps):
            for kind, src in (("table", table), ("files", vol)):
                out = fn.distributed("table" if kind == "table" else "volume", src, WORKERS, 3, cut)
                for arm in ("fresh", "rest"):
                    secs = max(r[arm] for r in out)  # the slower rank
                    first = max(r[arm + "_first"] for r in out)
                    got = sum(r[arm + "_samples"] for r in out)
                    t.setdefault(f"{kind}_{arm}", []).append(secs)
                    t.setdefault(f"{kind}_{arm}_first", []).append(first)
                    t.setdefault(f"{kind}_{arm}_after_first", []).append(secs - first)
                    n[f"{kind}_{arm}"] = got
        per_s = {k: n[k] / median(v) for k, v in t.items() if k in n}
        after = {k: n[k] / median(t[k + "_after_first"]) for k in n}  # after the first batch
        return {
            "name": "elastic",
            "rows": rows,
            "files": files,
            "cut": cut,
            "loadavg": round(os.getloadavg()[0], 1),
            "samples": n,
            "per_s": {k: round(v) for k, v in per_s.items()},
            "first_batch_s": {k: round(median(t[k + "_first"]), 3) for k in n},
            "results": {k: summary(v) for k, v in t.items()},
            "ratios": {
                "table_rest_vs_fresh": ratio(1 / per_s["table_fresh"], 1 / per_s["table_rest"]),
                "files_rest_vs_fresh": ratio(1 / per_s["files_fresh"], 1 / per_s["files_rest"]),
                # the reading itself, once the pass is set up (its first batch out)
                "table_rest_vs_fresh_after_first": ratio(
                    1 / after["table_fresh"], 1 / after["table_rest"]
                ),
                "files_rest_vs_fresh_after_first": ratio(
                    1 / after["files_fresh"], 1 / after["files_rest"]
                ),
            },
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def held(reps: int, rows: int = 2_000_000, files: int = 4000) -> dict:
    """Whole epochs, the global batch held against the per-rank order (see the docstring)."""
    import bench_tables

    from gangrun import distributed

    work = tempfile.mkdtemp(prefix="bench-held-")
    try:
        table = os.path.join(work, "table")
        bench_tables._write(table, rows, 8)
        vol = os.path.join(work, "files")
        _files(vol, files)
        gang = distributed(processes=2, mlflow=False, timeout=1800, output="none")
        fn = gang(elastic_ranks.held_vs_rank)
        fn.distributed("table", table, WORKERS, 1)  # warm-up: page cache, fork server
        fn.distributed("volume", vol, WORKERS, 1)
        out: dict = {"name": "elastic_held", "rows": rows, "files": files, "reps": reps}
        for kind, src in (("table", table), ("files", vol)):
            got = fn.distributed("table" if kind == "table" else "volume", src, WORKERS, reps)
            for arm in ("rank", "held", "held_one_lane"):
                secs = [max(r[arm][i] for r in got) for i in range(reps)]  # the slower rank
                n = sum(r[arm + "_samples"] for r in got)
                out[f"{kind}_{arm}"] = {"samples": n, "per_s": round(n / median(secs))}
                out.setdefault("results", {})[f"{kind}_{arm}"] = summary(secs)
            for arm in ("held", "held_one_lane"):
                out.setdefault("ratios", {})[f"{kind}_{arm}_vs_rank"] = ratio(
                    out[f"{kind}_{arm}"]["per_s"], out[f"{kind}_rank"]["per_s"]
                )
        out["loadavg"] = round(os.getloadavg()[0], 1)
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    import argparse
    import json

    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--rows", type=int, default=2_000_000)
    p.add_argument("--files", type=int, default=4000)
    p.add_argument("--cut", type=float, default=0.3)
    p.add_argument("--held", action="store_true", help="the global batch held vs per-rank")
    a = p.parse_args()
    if a.held:
        print(json.dumps(held(a.reps, a.rows, a.files), indent=1))
        return
    print(json.dumps(run(a.reps, a.rows, a.files, a.cut), indent=1))


if __name__ == "__main__":
    main()
