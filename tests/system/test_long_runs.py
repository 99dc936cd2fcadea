"""Long runs: a Checkpointer-driven training interrupted every way, then resumed, ends exactly
where an uninterrupted run of the same seed ends (docs/long_runs.md).

For DDP, FSDP2 (``fully_shard``) and DeepSpeed ZeRO-2, on 2 CPU ranks (gloo), with real DCP
files on a local directory and on a loopback S3 server (moto): (a) a rank SIGKILLed at a
random step, restarted by ``max_restarts``; (b) the caller SIGKILLed, the run resumed with
``run_id=`` from this process; (c) a preemption (``handle.cancel(checkpoint=True)``, SIGTERM
to a rank, SIGTERM to every process of the job: the caller, the fork server, the ranks and
their DataLoader workers), then ``run_id=``. Each ends with bitwise the same
parameters and the same loss per step, each step logged exactly once in the MLflow run. The
state includes a shuffled VolumeLoader over real files stopped mid-epoch.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import time

import ckptfns
import pytest

import gangrun
from conftest import assert_no_survivors
from gangrun import checkpoint
from s3server import moto_s3

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow

TOTAL, EVERY = 8, 3
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("long-runs-data"))
    ckptfns.write_data(root)  # 12 files: 6 per rank and epoch, 8 steps cross an epoch
    return root


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on 127.0.0.1 with bucket ``gangrun-ckpt``; fsspec in this process and
    in the ranks (they inherit the environment) reaches it by its config variables."""
    with moto_s3("gangrun-ckpt", default_endpoint=True) as (endpoint, _):
        yield "s3://gangrun-ckpt", {"endpoint_url": endpoint}


def _train(**opts):
    opts = {"processes": 2, "timeout": 240, "output": "rank0", "grace_period": 60, **opts}
    return gangrun.distributed(**opts)(ckptfns.train)


_baselines: dict[str, dict] = {}


def baseline(framework, data, tmp_path_factory, workers=0):
    """The uninterrupted run (cached per framework and DataLoader worker count: workers
    interleave the samples differently), and its checkpoints: the last K kept."""
    key = f"{framework}-{workers}"
    if key not in _baselines:
        where = str(tmp_path_factory.mktemp(f"base-{key}"))
        out = _train(checkpoint_dir=where).distributed(
            framework, data, TOTAL, EVERY, workers=workers
        )
        kept = checkpoint.list_checkpoints(where)
        assert [k.rsplit("-", 1)[1] for k in kept] == ["000000006", "000000008"]  # keep=2
        _baselines[key] = out[0]
    return _baselines[key]


def _history(run_id):
    from mlflow.tracking import MlflowClient

    return sorted((m.step, m.value) for m in MlflowClient().get_metric_history(run_id, "loss"))


def _assert_same(base, out, run_id):
    """Bitwise the same parameters, and each step's loss logged exactly once, as in base."""
    got = out[0]
    assert got["params"].keys() == base["params"].keys()
    for k, v in base["params"].items():
        assert torch.equal(got["params"][k], v), f"parameter {k} differs after the resume"
    assert _history(run_id) == sorted(base["losses"].items())
    # the resumed attempt replayed only the steps after its checkpoint, with the same losses
    assert got["start"] > 0 and got["restored_from"]
    for step, loss in got["losses"].items():
        assert loss == base["losses"][step]


def _where(kind, tmp_path, s3):
    """(checkpoint_dir, storage options for the ranks)."""
    if kind == "s3":
        return f"{s3[0]}/{tmp_path.name}", s3[1]
    return str(tmp_path / "ckpt"), None


def _wait_for(cond, what, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


# The matrix is a covering, not a product: every framework is interrupted, restored and compared
# in at least two of the modes (a), (b), (c), both storages are in (a) and (b), and each of the
# five ways to stop a run is there once or more. The restore a mode leads to is the framework's
# (its state_dict / DCP / engine checkpoint, the same Checkpointer.restore in every mode); how the
# run was stopped and found again is the mode's, the same code for every framework.
# ---------------------------------------------------------------------- (a) rank SIGKILLed
@pytest.mark.parametrize(("framework", "where"), [("ddp", "s3"), ("deepspeed", "local")])
@pytest.mark.mlflow
def test_rank_killed_at_random_step_restarted_by_max_restarts(
    framework, where, data, tmp_path, tmp_path_factory, request
):
    base = baseline(framework, data, tmp_path_factory)
    s3 = request.getfixturevalue("s3") if where == "s3" else None
    kill_at = random.Random(os.urandom(8)).randrange(EVERY, TOTAL - 1)
    print(f"rank 1 is SIGKILLed after step {kill_at}")
    root, so = _where(where, tmp_path, s3)
    handle = _train(checkpoint_dir=root, max_restarts=1).submit(
        framework, data, TOTAL, EVERY, so, kill_at=kill_at, marker=str(tmp_path / "killed")
    )
    out = handle.result()
    assert os.path.exists(tmp_path / "killed")
    assert out[0]["start"] <= kill_at
    _assert_same(base, out, handle.mlflow_run_id)


# ---------------------------------------------------------------------- (b) caller SIGKILLed
CALLER = """
import sys
sys.path.insert(0, {here!r})
import gangrun, ckptfns
train = gangrun.distributed(processes=2, timeout=240, output="none")(ckptfns.train)
h = train.options(checkpoint_dir={where!r}).submit(
    {framework!r}, {data!r}, {total}, {every}, {so!r}, block_at={block}, gate={gate!r},
    workers={workers})
open({idfile!r}, "w").write(h.mlflow_run_id)
h.result()
"""


def _caller(script, tmp_path, framework, data, where, block, so=None, workers=0):
    gate = str(tmp_path / "gate")
    code = CALLER.format(
        workers=workers,
        here=HERE,
        where=where,
        framework=framework,
        data=data,
        total=TOTAL,
        every=EVERY,
        block=block,
        gate=gate,
        idfile=str(tmp_path / "run_id"),
        so=so,
    )
    proc = script(code)
    _wait_for(lambda: all(os.path.exists(f"{gate}.reached.{r}") for r in (0, 1)), "the gate")
    return proc, gate, open(tmp_path / "run_id").read()


@pytest.mark.parametrize(("framework", "where"), [("ddp", "s3"), ("fsdp2", "local")])
@pytest.mark.mlflow
def test_caller_killed_then_resumed_with_run_id(
    framework, where, data, tmp_path, tmp_path_factory, script, request
):
    base = baseline(framework, data, tmp_path_factory)
    s3 = request.getfixturevalue("s3") if where == "s3" else None
    root, so = _where(where, tmp_path, s3)
    proc, _, run_id = _caller(script, tmp_path, framework, data, root, EVERY + 1, so)
    # the checkpoint of step EVERY is committed (async) by now or soon; then the caller dies
    _wait_for(lambda: checkpoint.latest(root) is not None, "the first checkpoint")
    proc.kill()
    proc.communicate(timeout=60)
    assert_no_survivors(proc.pid)  # its ranks followed it (liveness pipe)
    out = _train(run_id=run_id).distributed(framework, data, TOTAL, EVERY, so)  # no path given
    assert out[0]["start"] == EVERY
    _assert_same(base, out, run_id)


# ---------------------------------------------------------------------- (c) preemption
@pytest.mark.parametrize(
    ("framework", "how"),
    [
        ("ddp", "cancel"),
        ("fsdp2", "sigterm-rank"),
        ("deepspeed", "sigterm-job"),
    ],
)
@pytest.mark.mlflow
def test_preempted_then_resumed(framework, how, data, tmp_path, tmp_path_factory, script):
    """``sigterm-job``: SIGTERM to every process of the job, as SLURM sends it (the caller,
    the fork server, the ranks and their 2 DataLoader workers each): the workers and the fork
    server used to die of it, failing the ranks before they could save. The caller's own
    SIGTERM handling (it asks every call to save and stop: the Kubernetes case, where only
    the caller is signalled) runs in it too; ``cancel`` holds the path where the ranks learn
    of the stop from the caller alone."""
    workers = 2 if how == "sigterm-job" else 0
    base = baseline(framework, data, tmp_path_factory, workers)
    root, block = str(tmp_path / "ckpt"), EVERY + 1
    if how == "sigterm-job":
        proc, gate, run_id = _caller(
            script, tmp_path, framework, data, root, block, workers=workers
        )
        import psutil

        job = psutil.Process(proc.pid).children(recursive=True)
        assert sum(p.name() == "pt_data_worker" for p in job) == 4
        for p in [psutil.Process(proc.pid), *job]:
            p.send_signal(signal.SIGTERM)
        time.sleep(0.5)  # not a timing assumption: a later stop is a later (exact) checkpoint
        open(gate, "w").close()
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 1, err
        assert "DistributedPreemptedError" in err and f"run_id={run_id!r}" in err, err
        assert_no_survivors(proc.pid)
    else:
        gate = str(tmp_path / "gate")
        handle = _train(checkpoint_dir=root).submit(
            framework, data, TOTAL, EVERY, block_at=block, gate=gate
        )
        _wait_for(lambda: all(os.path.exists(f"{gate}.reached.{r}") for r in (0, 1)), "gate")
        if how == "cancel":
            assert handle.cancel(checkpoint=True, wait=0)
        else:
            os.kill(handle._run.gang.pids[1], signal.SIGTERM)  # from outside, one rank only
        time.sleep(0.5)
        open(gate, "w").close()
        with pytest.raises(gangrun.DistributedPreemptedError) as info:
            handle.result(timeout=180)
        err, run_id = info.value, handle.mlflow_run_id
        assert err.step >= block + 1 and err.checkpoint.endswith(f"step-{err.step:09d}")
        assert err.mlflow_run_id == run_id and f"run_id={run_id!r}" in str(err)
        assert checkpoint.is_complete(err.checkpoint)
        from mlflow.tracking import MlflowClient

        assert MlflowClient().get_run(run_id).info.status == "KILLED"
    out = _train(run_id=run_id).distributed(framework, data, TOTAL, EVERY, workers=workers)
    _assert_same(base, out, run_id)


# ---------------------------------------------------------------------- bad input, teardown
@pytest.mark.mlflow
def test_bad_checkpoint_locations_are_launch_errors(tmp_path, data):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(gangrun.LaunchError, match="cannot be written"):
        _train(checkpoint_dir=str(blocker / "ckpt")).distributed("ddp", data)
    # a run whose recorded checkpoints are gone: said so, not silently restarted at step 0
    root = tmp_path / "ckpt"
    handle = _train(checkpoint_dir=str(root)).submit("ddp", data, 4, 2)
    handle.result()
    import shutil

    shutil.rmtree(root)
    with pytest.raises(gangrun.LaunchError, match="no complete checkpoint is there now"):
        _train(run_id=handle.mlflow_run_id).distributed("ddp", data, 4, 2)


def stateless(where: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    gangrun.Checkpointer({"step": 0, "lock": object()}, dir=where).restore()


def test_state_without_state_names_key_and_rank(tmp_path):
    fn = gangrun.distributed(processes=2, timeout=120)(stateless)
    with pytest.raises(gangrun.DistributedError) as info:
        fn.distributed(str(tmp_path / "ckpt"))
    assert "state['lock']" in str(info.value) and "no state to save" in str(info.value)
    assert f"on rank {info.value.rank}" in str(info.value)


def fail_while_peer_checkpoints(where: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    gangrun.Checkpointer({"w": torch.zeros(2)}, dir=where).restore()  # SIGTERM handler on
    if dist.get_rank() == 1:
        raise ValueError("rank 1 fails")
    dist.all_reduce(torch.ones(1))  # rank 0 blocks in gloo until it is torn down


@pytest.mark.timeout(150)
def test_teardown_is_immediate_with_a_checkpointer_active(tmp_path):
    # With grace_period=600 a rank that waited to checkpoint would outlive the test timeout:
    # the SIGTERM of the teardown must kill it at once, even while blocked in a collective.
    fn = gangrun.distributed(processes=2, timeout=120, grace_period=600)(
        fail_while_peer_checkpoints
    )
    with pytest.raises(gangrun.DistributedError) as info:
        fn.distributed(str(tmp_path / "ckpt"))
    assert info.value.rank == 1 and isinstance(info.value.__cause__, ValueError)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-v"]))
