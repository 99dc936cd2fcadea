"""(6) Parent cost: ``import gangrun`` time (fresh interpreters) and caller RSS growth per call."""

from __future__ import annotations

import subprocess
import sys

import workloads
from _common import SRC, main, summary

_IMPORT = (
    "import sys, time; sys.path.insert(0, %r); t = time.perf_counter(); import gangrun; "
    "dt = time.perf_counter() - t; "
    "heavy = [m for m in ('torch', 'mlflow', 'ray', 'numpy') if m in sys.modules]; "
    "print(dt, ','.join(heavy))"
)


def run(reps: int) -> dict:
    import psutil

    imports: list[float] = []
    heavy: set[str] = set()
    for _ in range(max(reps, 7)):
        out = subprocess.run(
            [sys.executable, "-c", _IMPORT % SRC], capture_output=True, text=True, check=True
        ).stdout.split()
        imports.append(float(out[0]))
        if len(out) > 1:
            heavy.update(out[1].split(","))

    from gangrun import distributed

    g = distributed(processes=2, mlflow=False, timeout=300)(workloads.relaunch_fn)
    for _ in range(3):
        g.distributed()
    me = psutil.Process()
    calls = max(20, 4 * reps)
    before = me.memory_info().rss
    for _ in range(calls):
        g.distributed()
    after = me.memory_info().rss
    return {
        "name": "parent",
        "results": {"import_s": summary(imports)},
        "heavy_modules_imported": sorted(heavy),
        "rss_before_mib": before / 2**20,
        "rss_after_mib": after / 2**20,
        "calls": calls,
        "rss_growth_per_call_kib": (after - before) / calls / 1024,
        "ratios": {},
    }


if __name__ == "__main__":
    main(run)
