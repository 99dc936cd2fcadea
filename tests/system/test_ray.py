"""backend="ray" on a real two-node Ray cluster started on this machine.

``ray.cluster_utils.Cluster`` starts a head and a second node (each with its own raylet and
one CPU), so two CPU ranks cannot share a node: rank 0 lands on one, rank 1 on the other.
The cluster is shared by the module's tests and torn down at the end (no raylet may survive).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import psutil
import pytest

pytest.importorskip("ray")

from gangrun import DistributedError, distributed  # noqa: E402

pytestmark = pytest.mark.slow

MB = 1 << 20


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    # Short, as raycluster's: Ray's socket paths (<temp>/session_<date>_<pid>/sockets/
    # plasma_store) must fit in 107 bytes, which pytest's tmp_path under an xdist worker
    # (/tmp/pytest-of-root/pytest-N/popen-gw0/ray0) does not leave room for.
    temp = tempfile.mkdtemp(prefix="grray-", dir="/tmp")
    saved = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = temp
    c = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "object_store_memory": 100 * MB, "include_dashboard": False},
    )
    c.add_node(num_cpus=1, object_store_memory=100 * MB)
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False, logging_level="WARNING")
    try:
        yield c
    finally:
        nodes = [c.head_node, *c.worker_nodes]
        pids = set()
        for node in nodes:
            for _, proc in node.live_processes():
                pids.add(proc.pid)
                try:
                    pids.update(ch.pid for ch in psutil.Process(proc.pid).children(recursive=True))
                except psutil.Error:
                    pass
        ray.shutdown()
        c.shutdown()
        deadline = time.monotonic() + 15
        while pids_alive(pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = pids_alive(pids)
        if saved is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = saved
        shutil.rmtree(temp, ignore_errors=True)
        assert not left, f"Ray processes survived the cluster shutdown: {left}"


def pids_alive(pids):
    # imported here, not at the top: the ranks import this module to find their function,
    # and importing conftest there would re-run its session setup in every rank
    from conftest import pids_alive

    return pids_alive(pids)


def _opts(cluster, **kw):
    env = {"GANGRUN_RAY_STRATEGY": "STRICT_SPREAD", **kw.pop("env", {})}
    return dict(processes=2, backend="ray", address=cluster.address, env=env, **kw)


def _assert_gang_gone(handle):
    """The actors, their rank processes and the placement group of a finished call are gone."""
    from ray.util import placement_group_table

    gang = handle._run.gang
    nodes = gang.spawner.nodes
    pids = [info.pid for info in nodes.values()] + list(gang.pids.values())
    deadline = time.monotonic() + 10
    while pids_alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pids_alive(pids), "actor or rank processes survived"
    states = {pg["state"] for pg in placement_group_table().values()}
    assert states <= {"REMOVED"}, states


def ddp_step(scale: float) -> dict:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    rank = dist.get_rank()
    loss = model(torch.full((2, 4), float(rank + 1))).sum() * scale
    loss.backward()
    grad = model.module.weight.grad.clone()
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    dist.destroy_process_group()
    print(f"node {os.environ['NODE_RANK']} done")
    return {
        "rank": rank,
        "node_id": os.environ["GANGRUN_RAY_NODE_ID"],
        "node_rank": int(os.environ["NODE_RANK"]),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "grad": grad.tolist(),
        "sum": total.item(),
    }


def test_ddp_on_two_nodes(cluster, capfd):
    fn = distributed(**_opts(cluster))(ddp_step)
    handle = fn.submit(0.5)
    r0, r1 = handle.result(timeout=120)
    assert (r0["rank"], r1["rank"]) == (0, 1)
    assert r0["node_id"] != r1["node_id"]  # really on two nodes
    assert (r0["node_rank"], r1["node_rank"]) == (0, 1)
    assert r0["local_rank"] == r1["local_rank"] == 0
    assert r0["sum"] == r1["sum"] == 1.0
    assert r0["grad"] == r1["grad"]  # DDP averaged the gradients across the nodes
    out = capfd.readouterr().out
    assert "[rank 0] node 0 done" in out and "[rank 1] node 1 done" in out
    assert "node 1 done" in handle.logs(1)
    _assert_gang_gone(handle)


def fail_on_second_node() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise ValueError(f"bad shard on node {os.environ['NODE_RANK']}")
    dist.barrier()  # rank 0 blocks here until the teardown stops it


def test_failure_on_second_node(cluster):
    fn = distributed(**_opts(cluster, grace_period=2.0))(fail_on_second_node)
    handle = fn.submit()
    t0 = time.monotonic()
    with pytest.raises(DistributedError) as info:
        handle.result(timeout=120)
    err = info.value
    assert err.rank == 1
    assert err.exc_type == "ValueError"
    assert "bad shard on node 1" in str(err)
    assert "Traceback" in err.traceback and "fail_on_second_node" in err.traceback
    assert isinstance(err.__cause__, ValueError)
    assert time.monotonic() - t0 < 60
    _assert_gang_gone(handle)


def log_to_mlflow() -> int:
    import mlflow

    rank = int(os.environ["RANK"])
    for step in range(3):
        mlflow.log_metric(f"loss_rank{rank}", 1.0 / (step + 1), step=step)
    mlflow.log_metric("node_rank", int(os.environ["NODE_RANK"]), step=rank)
    return rank


@pytest.mark.mlflow
def test_mlflow_metrics_from_both_nodes(cluster):
    from mlflow.tracking import MlflowClient

    client = MlflowClient()  # the session's sqlite store (conftest sets MLFLOW_TRACKING_URI)
    exp = client.get_experiment_by_name("Default") or client.get_experiment("0")
    own = client.create_run(exp.experiment_id).info.run_id
    env = {"MLFLOW_RUN_ID": own, "MLFLOW_TRACKING_URI": os.environ["MLFLOW_TRACKING_URI"]}
    fn = distributed(**_opts(cluster, env=env))(log_to_mlflow)
    handle = fn.submit()
    assert handle.result(timeout=120) == [0, 1]
    run_id = handle.mlflow_run_id or own  # gangrun's own run once tracking is on
    for rank in (0, 1):
        hist = client.get_metric_history(run_id, f"loss_rank{rank}")
        assert [m.value for m in sorted(hist, key=lambda m: m.step)] == [1.0, 0.5, 1.0 / 3]
    nodes = client.get_metric_history(run_id, "node_rank")
    assert sorted((m.step, m.value) for m in nodes) == [(0, 0.0), (1, 1.0)]
    _assert_gang_gone(handle)


def wait_then_sleep(flag_dir: str) -> None:
    open(os.path.join(flag_dir, f"ready.{os.environ['RANK']}"), "w").close()
    time.sleep(60)


def test_lost_actor_names_its_ranks(cluster, tmp_path):
    import ray

    fn = distributed(**_opts(cluster, grace_period=1.0))(wait_then_sleep)
    handle = fn.submit(str(tmp_path))
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("ready.*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    ray.kill(handle._run.gang.spawner.actors[1])  # as if rank 1's node went away
    with pytest.raises(DistributedError) as info:
        handle.result(timeout=60)
    err = info.value
    assert err.rank == 1
    assert "was lost" in str(err) and "ranks [1] ran on that node" in str(err)
    _assert_gang_gone(handle)


CALLER = """
import os, sys, time
from gangrun import distributed

def wait_then_sleep(flag_dir):
    open(os.path.join(flag_dir, f"ready.{os.environ['RANK']}"), "w").close()
    time.sleep(120)

address, flag_dir = sys.argv[1], sys.argv[2]
fn = distributed(processes=2, backend="ray", address=address,
                 env={"GANGRUN_RAY_STRATEGY": "STRICT_SPREAD"})(wait_then_sleep)
fn.distributed(flag_dir)
"""


def test_caller_killed_leaves_nothing(cluster, tmp_path, script):
    import signal

    from conftest import assert_no_survivors, run_processes

    flags = tmp_path / "flags"
    flags.mkdir()
    caller = script(CALLER, cluster.address, str(flags))
    deadline = time.monotonic() + 90
    while len(list(flags.glob("ready.*"))) < 2 and time.monotonic() < deadline:
        assert caller.poll() is None, caller.communicate()
        time.sleep(0.2)
    assert len(run_processes(caller.pid)) >= 2
    caller.send_signal(signal.SIGKILL)  # the kernel dies: Ray drops its actors, ranks follow
    caller.communicate(timeout=30)
    assert_no_survivors(caller.pid, wait=30)
    # No actor directory (with its payload.pkl) is left on the nodes.
    deadline = time.monotonic() + 30
    while _actor_dirs() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _actor_dirs(), "the rank actors' directories outlived their caller"


def _actor_dirs() -> list[str]:
    import tempfile

    from gangrun.launch.ray.actor import PREFIX

    return [n for n in os.listdir(tempfile.gettempdir()) if n.startswith(PREFIX)]


def test_next_call_reaps_leftovers_on_its_nodes(cluster, tmp_path):
    """A directory left by an actor that is gone is removed by the next call that
    places a rank on that node (simulated: an actor identity that names no live process)."""
    import tempfile

    from gangrun.launch.ray.actor import OWNER, PREFIX

    stale = tempfile.mkdtemp(prefix=f"{PREFIX}deadbeef-r0-")
    with open(os.path.join(stale, OWNER), "w") as f:
        f.write("999999999:1")  # no such pid
    with open(os.path.join(stale, "payload.pkl"), "wb") as f:
        f.write(b"x")
    fn = distributed(**_opts(cluster))(os.getpid)
    assert len(fn.distributed()) == 2
    assert not os.path.exists(stale)
    assert not _actor_dirs()


CLI_SCRIPT = """
import os, sys
print(f"rank {os.environ['RANK']} on node {os.environ['NODE_RANK']} argv={sys.argv[1:]}")
if os.environ["RANK"] == "1":
    import time
    time.sleep(1.0)  # rank 0 has printed by now: its line must reach the caller
    sys.exit(int(sys.argv[1]))
"""


def test_cli_on_ray_exit_code(cluster, tmp_path):
    import subprocess
    import sys

    from conftest import assert_no_survivors

    (tmp_path / "train.py").write_text(CLI_SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gangrun", "run", "--backend", "ray", "--address"]
        + [cluster.address, "--processes", "2", "--no-mlflow"]
        + ["--env", "GANGRUN_RAY_STRATEGY=STRICT_SPREAD", "train.py", "3"],
        cwd=str(tmp_path),
        # the logs the failed run keeps (gangrun-logs-*) go under the test's tmp_path
        env=dict(os.environ, TMPDIR=str(tmp_path)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = proc.communicate(timeout=120)
    assert_no_survivors(proc.pid)
    assert proc.returncode == 3, err
    assert "[rank 0] rank 0 on node 0 argv=['3']" in out
    assert "[rank 1] rank 1 on node 1 argv=['3']" in out
    assert "Rank 1" in err and "exited with code 3" in err
    assert f"Full logs: {tmp_path}/gangrun-logs-" in err, err


def test_more_than_the_cluster_has_is_a_launch_error(cluster):
    from gangrun import LaunchError

    with pytest.raises(LaunchError, match="cluster has 2 CPU"):
        distributed(**{**_opts(cluster), "processes": 3})(log_to_mlflow).submit()
    with pytest.raises(LaunchError, match="gpus=1 but the Ray cluster has 0 GPU"):
        distributed(gpus=1, backend="ray", address=cluster.address)(log_to_mlflow).submit()


def node_rank_and_world() -> tuple[int, int]:
    return int(os.environ["NODE_RANK"]), int(os.environ["WORLD_SIZE"])


def test_torch_distributor_cluster_mode(cluster):
    from gangrun.compat import TorchDistributor

    d = TorchDistributor(
        num_processes=2,
        local_mode=False,
        use_gpu=False,
        backend="ray",
        address=cluster.address,
        mlflow=False,
        env={"GANGRUN_RAY_STRATEGY": "STRICT_SPREAD"},
    )
    assert d.run(node_rank_and_world) == (0, 2)  # rank 0's value, as Spark returns


def uses_shipped_module() -> tuple:
    import importlib

    mod = importlib.import_module("shipped_mod_gangrun_test")
    return mod.VALUE, os.environ.get("SHIPPED_VAR"), os.path.basename(os.getcwd())


def test_runtime_env_ships_working_dir(cluster, tmp_path):
    import json

    wd = tmp_path / "project"
    wd.mkdir()
    (wd / "shipped_mod_gangrun_test.py").write_text("VALUE = 42\n")
    rt = {"working_dir": str(wd), "env_vars": {"SHIPPED_VAR": "yes"}}
    fn = distributed(**_opts(cluster, env={"GANGRUN_RAY_RUNTIME_ENV": json.dumps(rt)}))
    out = fn(uses_shipped_module).distributed()
    assert [o[:2] for o in out] == [(42, "yes"), (42, "yes")]
    # both nodes of this cluster see the caller's files: the ranks run in the caller's real
    # directory, not in Ray's copy (a relative checkpoint path lands where the user expects)
    assert [o[2] for o in out] == [os.path.basename(os.getcwd())] * 2


def step_then_raise() -> None:
    import gangrun

    gangrun.report_step(1)  # written on the rank's node: the caller reads it for the rules
    raise ValueError("the same line on every attempt")


def test_step_reports_reach_the_restart_rules(cluster):
    """An exception after progress is retried once (then it repeats at the same line): the
    ranks' step reports came back from their nodes (without them: no progress, 1 attempt)."""
    fn = distributed(**_opts(cluster, max_restarts=3, restart_backoff=0.1))
    with pytest.raises(DistributedError) as ei:
        fn(step_then_raise).distributed()
    text = str(ei.value)
    assert "2 attempts ran (max_restarts=3); restarts stopped: the same ValueError at " in text
