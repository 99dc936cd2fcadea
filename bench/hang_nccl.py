"""GPU smoke step: the hang verdict on NCCL ranks, with torch's Flight Recorder read.

Rank 1 skips one ``all_reduce`` (it sleeps); the call must end within hang_timeout + 5 s with
`DistributedHangError` naming rank 1, the collective's line, and on NCCL each answering rank's
Flight Recorder state ("Flight Recorder: last all_reduce #N ..."). Prints ``OK`` last.
Run by bench/gpu_smoke.sh (``GANGRUN_SMOKE_ALLOW_CPU=1``: gloo ranks, no Flight Recorder).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

T = 5.0


def skipped(began: str) -> None:
    import torch
    import torch.distributed as dist

    import gangrun

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    dev = gangrun.device()
    t = torch.ones(4, device=dev)
    dist.all_reduce(t)
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    if dist.get_rank() == 1:
        with open(began, "w") as f:
            f.write(str(time.time()))
        time.sleep(600)
    dist.all_reduce(t)  # the collective rank 0 waits in
    torch.cuda.synchronize() if torch.cuda.is_available() else None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-mlflow", action="store_true")
    ap.parse_args()
    import torch

    import gangrun

    n = torch.cuda.device_count()
    if n < 2 and os.environ.get("GANGRUN_SMOKE_ALLOW_CPU") != "1":
        print(f"{n} GPU: a hang needs two ranks; skipped")
        print("OK")
        return 0
    world = {"gpus": 2} if n >= 2 else {"processes": 2}
    began = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"gangrun-hang-{os.getpid()}")
    fn = gangrun.distributed(**world, timeout=300, hang_timeout=T, mlflow=False)(skipped)
    try:
        fn.distributed(began)
    except gangrun.DistributedHangError as err:
        with open(began) as f:
            delay = time.time() - float(f.read())
        text = str(err)
        print(text.split("Python stacks")[0])
        print(f"2 ranks, verdict {delay:.1f}s after the hang began (T={T:g}s)")
        assert err.rank == 1 and err.hang.op.op == "all_reduce", text
        assert delay < T + 5, delay
        if n >= 2:
            assert "Flight Recorder: last all_reduce" in text, "no Flight Recorder state"
        print("OK")
        return 0
    finally:
        if os.path.exists(began):
            os.unlink(began)
    print("no DistributedHangError")
    return 1


if __name__ == "__main__":
    sys.exit(main())
