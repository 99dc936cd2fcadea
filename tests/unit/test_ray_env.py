"""The per-node torchrun environment of Ray ranks (no cluster needed)."""

from __future__ import annotations

from conftest import run_python
from gangrun.launch import GangSpec, RankSpec
from gangrun.launch.ray import node_envs
from gangrun.launch.ray.records import NodeInfo


def _spec(n: int) -> GangSpec:
    ranks = [
        RankSpec(r, {"RANK": str(r), "WORLD_SIZE": str(n), "CUDA_VISIBLE_DEVICES": "7"})
        for r in range(n)
    ]
    return GangSpec("rid", "/tmp/x", ranks, "/tmp/x/logs")


def test_ranks_interleaved_over_two_gpu_nodes():
    nodes = {
        0: NodeInfo("A", "10.0.0.1", gpu_ids=("3",), cpus=16),
        1: NodeInfo("B", "10.0.0.2", gpu_ids=("0",), cpus=8),
        2: NodeInfo("A", "10.0.0.1", gpu_ids=("5",), cpus=16),
        3: NodeInfo("B", "10.0.0.2", gpu_ids=("1",), cpus=8),
    }
    envs = node_envs(_spec(4).ranks, nodes, 29500, user_omp=False)
    got = {
        r: (e["NODE_RANK"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"], e["CUDA_VISIBLE_DEVICES"])
        for r, e in envs.items()
    }
    assert got == {
        0: ("0", "0", "2", "3,5"),
        1: ("1", "0", "2", "0,1"),
        2: ("0", "1", "2", "3,5"),
        3: ("1", "1", "2", "0,1"),
    }
    for e in envs.values():
        assert e["MASTER_ADDR"] == "10.0.0.1" and e["MASTER_PORT"] == "29500"
        assert e["GROUP_WORLD_SIZE"] == "2"
    assert envs[0]["OMP_NUM_THREADS"] == "8" and envs[1]["OMP_NUM_THREADS"] == "4"
    assert envs[3]["GANGRUN_RAY_NODE_IP"] == "10.0.0.2"


def test_cpu_ranks_keep_user_threads_and_drop_caller_devices():
    nodes = {r: NodeInfo("A", "1.2.3.4", gpu_ids=(), cpus=4) for r in range(2)}
    spec = _spec(2)
    for rs in spec.ranks:
        rs.env["OMP_NUM_THREADS"] = "3"
    envs = node_envs(spec.ranks, nodes, 1234, user_omp=True)
    assert [e["LOCAL_RANK"] for e in envs.values()] == ["0", "1"]
    assert all(e["OMP_NUM_THREADS"] == "3" for e in envs.values())
    assert all("CUDA_VISIBLE_DEVICES" not in e for e in envs.values())  # the caller's "7"


def test_import_does_not_import_ray():
    code = (
        "import sys, gangrun.launch.ray, gangrun.cli, gangrun.compat; print('ray' in sys.modules)"
    )
    out = run_python(code, check=True)
    assert out.stdout.strip() == "False"
