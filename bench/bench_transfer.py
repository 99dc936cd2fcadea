"""(4) Result transfer: 2 ranks each returning a 256 MiB tensor.

gangrun's cost = (call returning the tensors, then reading them in full with a sum) - (the
same call returning nothing; the tensors are still built).
Baseline: ``torch.save`` of the same two tensors into the same directory (the run
directories' temp dir), ``torch.load`` back and a sum of each, in one process.
"""

from __future__ import annotations

import os
import tempfile
import time

import workloads
from _common import main, ratio, summary, timed

NBYTES = 256 << 20


def run(reps: int) -> dict:
    import torch

    reps = max(reps, 9)  # bimodal on a 2-core machine (page-cache and allocator effects)

    from gangrun import distributed

    g = distributed(processes=2, mlflow=False, timeout=600)(workloads.big_result)

    def baseline() -> float:
        ts = [workloads.big_result(NBYTES) for _ in range(2)]
        d = tempfile.mkdtemp(prefix="bench-save-")  # same disk as gangrun's run dirs
        try:
            t = time.perf_counter()
            paths = []
            for i, x in enumerate(ts):
                p = os.path.join(d, f"r{i}.pt")
                torch.save(x, p)
                paths.append(p)
            back = [torch.load(p) for p in paths]
            touched = [float(b.sum()) for b in back]  # read every byte, as a user would
            dt = time.perf_counter() - t
            assert all(b.numel() == NBYTES // 4 for b in back) and touched
            return dt
        finally:
            for name in os.listdir(d):
                os.unlink(os.path.join(d, name))
            os.rmdir(d)

    g.distributed(4096)
    full: list[float] = []
    empty: list[float] = []
    base: list[float] = []
    for _ in range(reps):
        # the results are read in full (summed) in both cases: gangrun maps the rank's file
        # pages instead of copying them, so an untouched result would cost it nothing
        dt, sums = timed(lambda: [float(o.sum()) for o in g.distributed(NBYTES)])
        assert sums == [float(NBYTES // 4)] * 2, sums
        full.append(dt)
        dt, _ = timed(lambda: g.distributed(NBYTES, False))
        empty.append(dt)
        base.append(baseline())
        time.sleep(0.2)
    transfer = [max(1e-9, f - e) for f, e in zip(full, empty, strict=True)]
    res = {
        "gangrun_call_with_result": summary(full),
        "gangrun_call_without_result": summary(empty),
        "gangrun_transfer": summary(transfer),
        "torch_save_load": summary(base),
    }
    return {
        "name": "transfer",
        "unit": "s",
        "bytes_per_rank": NBYTES,
        "results": res,
        "ratios": {
            "gangrun_vs_save_load": ratio(
                res["gangrun_transfer"]["median"], res["torch_save_load"]["median"]
            )
        },
    }


if __name__ == "__main__":
    main(run)
