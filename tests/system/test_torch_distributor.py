"""gangrun.compat.TorchDistributor runs Spark TorchDistributor code unchanged on one node."""

from __future__ import annotations

import os
import textwrap

import pytest

from gangrun import DistributedError, LaunchError
from gangrun.compat import TorchDistributor


def train(lr: float, epochs: int = 1) -> dict:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")  # the env:// rendezvous TorchDistributor provides
    rank = dist.get_rank()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    dist.destroy_process_group()
    return {
        "rank": rank,
        "world": int(os.environ["WORLD_SIZE"]),
        "sum": t.item(),
        "lr": lr * epochs,
    }


@pytest.mark.slow
def test_function_returns_rank0_value():
    out = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False, mlflow=False).run(
        train, 0.5, epochs=2
    )
    assert out == {"rank": 0, "world": 2, "sum": 3.0, "lr": 1.0}


def test_script_runs_on_every_rank_and_returns_none(tmp_path, monkeypatch):
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, sys
            if __name__ == "__main__":
                rank = os.environ["RANK"]
                with open(os.path.join(sys.argv[2], f"done.{rank}"), "w") as f:
                    f.write(" ".join(sys.argv[1:]))
            """
        )
    )
    monkeypatch.chdir(tmp_path)
    d = TorchDistributor(num_processes=2, use_gpu=False, mlflow=False)
    assert d.run("train.py", "--out", str(tmp_path)) is None
    for rank in (0, 1):
        assert (tmp_path / f"done.{rank}").read_text() == f"--out {tmp_path}"


def failing(x: int) -> None:
    if int(os.environ["RANK"]) == 1:
        raise ValueError(f"bad {x}")


def test_failure_is_a_runtime_error():
    d = TorchDistributor(num_processes=2, use_gpu=False, mlflow=False)
    with pytest.raises(RuntimeError) as info:
        d.run(failing, 7)
    assert isinstance(info.value, DistributedError) and info.value.rank == 1
    assert "bad 7" in str(info.value)


def test_local_mode_false_needs_ray():
    with pytest.raises(LaunchError, match="backend='ray'"):
        TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)


def test_use_gpu_without_gpu_is_a_clear_error():
    if os.path.exists("/dev/nvidiactl"):
        pytest.skip("this machine has a GPU")
    with pytest.raises(LaunchError, match="processes="):
        TorchDistributor(num_processes=1, use_gpu=True, mlflow=False).run(failing, 1)
