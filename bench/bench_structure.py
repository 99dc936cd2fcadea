"""Before/after a refactor: the same gangrun paths measured on two source trees, interleaved.

    PYTHONPATH=src python bench/bench_structure.py --before ../before/src --after src --rounds 3

Each round runs one probe process per tree, in alternating order (before, after; then after,
before), so machine noise hits both alike. A probe measures, on its tree:

- ``import_s``: ``python -c "import gangrun"`` (a fresh interpreter; measured by the driver);
- ``warm_relaunch_s``: a 2-rank call of a function that imports torch, warm fork server;
- ``failure_s``: rank 1 raises while rank 0 blocks in a gloo all_reduce: when the caller holds
  the exception - when rank 1 raised;
- ``gang_execute_s``: ``Gang.execute("1")`` on a warm 2-rank gang;
- ``table_epoch_s``: a 2-rank x 2-worker `TableDataset` epoch (workers kept, second epoch);
- ``async_save_blocked_s``: the step blocked by an async FSDP2 save (2 ranks);

each the median of its repetitions. The ratios printed are after / before of the medians
over the rounds: within noise means close to 1 on both sides. The bench helpers
(``workloads``, ``table_ranks``, ``bench_checkpoint``) use the public API only, so one copy
drives both trees.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
METRICS = (
    "import_s",
    "warm_relaunch_s",
    "failure_s",
    "gang_execute_s",
    "table_epoch_s",
    "async_save_blocked_s",
)


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def probe(table: str, work: str) -> dict[str, float]:
    """Inside a probe process: every metric but the import's, on the tree it imports."""
    import glob

    import bench_checkpoint
    import table_ranks
    import workloads

    import gangrun
    from gangrun import DistributedError, distributed

    out: dict[str, float] = {}
    relaunch = distributed(processes=2, mlflow=False, timeout=300)(workloads.relaunch_fn)
    relaunch.distributed()  # the warm state: a fork server exists
    times = []
    for _ in range(5):
        t = time.perf_counter()
        relaunch.distributed()
        times.append(time.perf_counter() - t)
    out["warm_relaunch_s"] = _median(times)

    failing = distributed(processes=2, mlflow=False, timeout=120)(workloads.failing)
    lat = []
    for i in range(3):
        d = tempfile.mkdtemp(prefix=f"fail{i}-", dir=work)
        try:
            failing.distributed(d)
        except DistributedError:
            held = time.time()
        [path] = glob.glob(os.path.join(d, "raised.*"))
        with open(path) as f:
            lat.append(held - float(f.read()))
    out["failure_s"] = _median(lat)

    with gangrun.Gang(processes=2, mlflow=False) as g:
        g.execute("1")
        times = []
        for _ in range(20):
            t = time.perf_counter()
            g.execute("1")
            times.append(time.perf_counter() - t)
    out["gang_execute_s"] = _median(times)

    epochs = distributed(processes=2, mlflow=False, timeout=600, output="rank0")(
        table_ranks.table_epochs
    )
    cache = tempfile.mkdtemp(prefix="cache-", dir=work)
    per_rank = epochs.distributed(table, {}, cache, 2, 4096, "torch", 2, False)
    out["table_epoch_s"] = max(r["times"][-1] for r in per_rank)

    save = distributed(processes=2, mlflow=False, timeout=600, output="rank0")(
        bench_checkpoint.ranks
    )
    where = tempfile.mkdtemp(prefix="ckpt-", dir=work)
    per_rank = save.distributed(0.125, 3, where)
    out["async_save_blocked_s"] = _median(
        [max(r["blocked"][i] for r in per_rank) for i in range(3)]
    )
    return out


def _write_table(root: str, rows: int) -> str:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(root, exist_ok=True)
    rng = np.random.default_rng(0)
    per = rows // 4
    for k in range(4):
        t = pa.table(
            {
                "id": np.arange(k * per, (k + 1) * per),
                "x": rng.random(per, dtype=np.float32),
                "label": rng.integers(0, 1000, per, dtype=np.int32),
            }
        )
        pq.write_table(t, os.path.join(root, f"part-{k}.parquet"), row_group_size=65536)
    return root


def _env(src: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(src), BENCH])
    env["MLFLOW_DISABLE_TELEMETRY"] = "true"
    return env


def _import_time(src: str) -> float:
    times = []
    for _ in range(5):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import gangrun"], env=_env(src), check=True)
        times.append(time.perf_counter() - t)
    return _median(times)


def _run_probe(src: str, table: str, work: str) -> dict[str, float]:
    code = (
        "import json, sys; import bench_structure as b; "
        "print('PROBE ' + json.dumps(b.probe(sys.argv[1], sys.argv[2])))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, table, work],
        env=_env(src),
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE ")]
    if proc.returncode or not lines:
        raise SystemExit(f"probe on {src} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    res = json.loads(lines[-1][6:])
    res["import_s"] = _import_time(src)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True, help="the before tree's src directory")
    ap.add_argument("--after", required=True, help="the after tree's src directory")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    trees = {"before": a.before, "after": a.after}
    series: dict[str, dict[str, list[float]]] = {k: {m: [] for m in METRICS} for k in trees}
    with tempfile.TemporaryDirectory(prefix="bench-structure-") as work:
        table = _write_table(os.path.join(work, "table"), a.rows)
        for r in range(a.rounds):
            order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
            for name in order:
                res = _run_probe(trees[name], table, work)
                for m in METRICS:
                    series[name][m].append(res[m])
                print(f"round {r + 1} {name}: " + json.dumps(res), flush=True)
    med = {k: {m: _median(v) for m, v in s.items()} for k, s in series.items()}
    ratios = {m: med["after"][m] / med["before"][m] for m in METRICS}
    result = {"name": "structure", "rounds": a.rounds, "medians": med, "series": series}
    result["ratios_after_vs_before"] = ratios
    print("\n| measure | before | after | after / before |\n|---|---|---|---|")
    for m in METRICS:
        print(f"| {m} | {med['before'][m]:.4f} | {med['after'][m]:.4f} | {ratios[m]:.3f} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
