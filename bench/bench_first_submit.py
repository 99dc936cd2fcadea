"""What a script's first ``submit()`` costs, next to the later ones.

Each repetition is a fresh interpreter (a script's first call: no fork server yet, MLflow not
imported) that submits a trivial 2-rank call three times, with MLflow on (a sqlite store made
beforehand, as after a first session) and off. Per submit it reports the wall time and the
CPU time the caller spent; for the first, also the CPU time of the caller's children at that
moment (the fork server importing torch). On a shared machine wall times grow with the load;
CPU times say what the work costs on an idle core.

    PYTHONPATH=src python bench/bench_first_submit.py --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time
import psutil
import gangrun

def f():
    return 1

fn = gangrun.distributed(processes=2, timeout=120, mlflow=sys.argv[1] == "on")(f)
rows = []
for i in range(3):
    c0, w0 = time.process_time(), time.perf_counter()
    h = fn.submit()
    row = {"wall": time.perf_counter() - w0, "cpu": time.process_time() - c0}
    if i == 0:
        kids = psutil.Process().children()
        row["children_cpu"] = sum(sum(p.cpu_times()[:2]) for p in kids)
    rows.append(row)
    h.result(120)
print("ROWS " + json.dumps(rows))
"""


def one(mlflow: str, store: str) -> list[dict[str, float]]:
    env = dict(
        os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{store}", MLFLOW_DISABLE_TELEMETRY="true"
    )
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mlflow], env=env, capture_output=True, text=True, timeout=600
    )
    if out.returncode != 0:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.split("ROWS ", 1)[1])  # type: ignore[no-any-return]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    reps = ap.parse_args().reps
    with tempfile.TemporaryDirectory() as d:
        store = os.path.join(d, "mlflow.db")
        one("on", store)  # the store exists from now on (its first creation is not measured)
        got: dict[str, list[list[dict[str, float]]]] = {"off": [], "on": []}
        for _ in range(reps):
            for mode in ("off", "on"):  # interleaved
                got[mode].append(one(mode, store))
    print(f"load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(
        "| MLflow | first submit wall | its CPU (caller) | fork server CPU | later submits wall |"
    )
    print("|---|---|---|---|---|")
    for mode, runs in got.items():
        med = statistics.median
        first = [r[0] for r in runs]
        later = [x["wall"] for r in runs for x in r[1:]]
        print(
            f"| {mode} | {med(x['wall'] for x in first):.2f} s | {med(x['cpu'] for x in first):.2f} s "
            f"| {med(x['children_cpu'] for x in first):.2f} s | {med(later):.2f} s |"
        )


if __name__ == "__main__":
    main()
