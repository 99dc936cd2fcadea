"""``min_ranks`` on a real two-raylet Ray cluster: a node is lost mid-run
and the call restarts on the ranks the cluster can still place, the state resharded.

The cluster (`raycluster.TwoRaylets`, one CPU each, the second raylet in its own mount
namespace) runs the seed's loop with `gangrun.data.DistributedSampler` and the global batch
held (`elasticfns.train`) on 2 ranks, one per node. Once a checkpoint is committed the second
node is killed (every process of its mount namespace, SIGKILL). The call restarts
(``max_restarts=1, min_ranks=1``) on the 1 rank the head can place, the Checkpointer
reshards 2 -> 1, and the run finishes: every sample of each epoch read once, every step's
loss within 1e-6 of an uninterrupted local run on 2 ranks, each attempt's world size
recorded, and the restart said in one line. Without ``min_ranks`` a call asks for its
full size again (covered by the restart tests); a local call refuses ``min_ranks``.
"""

from __future__ import annotations

import os
import signal
import time

import elasticfns as ef
import psutil
import pytest

import gangrun
from gangrun import LaunchError

pytest.importorskip("ray")
pytestmark = pytest.mark.slow

STEPS = ef.EPOCHS * ef.N // ef.GLOBAL_BATCH


def _other_namespace(cluster) -> list[psutil.Process]:
    """The second raylet's processes: the cluster's, in another mount namespace than ours."""
    mine = os.readlink("/proc/self/ns/mnt")
    out = []
    for p in cluster.processes():
        try:
            if os.readlink(f"/proc/{p.pid}/ns/mnt") != mine:
                out.append(p)
        except OSError:
            continue
    return out


def test_min_ranks_is_refused_on_this_node():
    run = gangrun.distributed(processes=2, max_restarts=1, min_ranks=1)(ef.train)
    with pytest.raises(LaunchError, match="backend='ray'"):
        run.distributed("ddp", 1)


def test_a_lost_node_restarts_the_call_on_the_ranks_left(tmp_path, capfd):
    from raycluster import running

    base = _baseline(tmp_path)
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    where = str(tmp_path / "ckpt")
    # Ray finds a dead node by health checks (default: about 15-30 s); faster here
    fast = {
        "RAY_health_check_initial_delay_ms": "0",
        "RAY_health_check_period_ms": "500",
        "RAY_health_check_timeout_ms": "500",
        "RAY_health_check_failure_threshold": "3",
    }
    with running(str(hidden), **fast) as c:  # nothing of the cluster survives it
        run = gangrun.distributed(
            processes=2, backend="ray", address=c.address, max_restarts=1, min_ranks=1,
            timeout=300, checkpoint_dir=where, restart_backoff=0, output="rank0",
            env={"GANGRUN_RAY_STRATEGY": "STRICT_SPREAD"},
        )(ef.train)  # fmt: skip
        handle = run.submit("ddp", STEPS, 0.5, 2)  # a checkpoint every 2 steps
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any(
            os.path.exists(os.path.join(where, d, "_COMPLETE"))
            for d in (os.listdir(where) if os.path.isdir(where) else [])
        ):
            time.sleep(0.1)
        assert not handle.done(), "the run ended before the second node was lost"
        victims = _other_namespace(c)
        assert victims, "no process of the second raylet found"
        for p in victims:
            p.send_signal(signal.SIGKILL)
        out = handle.result(timeout=240)
        err = capfd.readouterr().err
    assert len(out) == 1 and out[0]["world"] == 1  # the second attempt: one rank
    stop = out[0]["start"]
    assert 0 < stop < STEPS
    assert "restarting train on 1 ranks" in err, err
    assert f"resumed step {stop} saved by 2 ranks onto 1" in err, err
    # every sample of each epoch read once across the two attempts' worlds: the second
    # attempt's reads, with the first's (2 ranks, `stop` global batches of the stream)
    for e in range(ef.EPOCHS):
        first = _first_reads(stop, e)
        ids = first + out[0]["reads"].get(e, [])
        assert sorted(ids) == list(range(ef.N)), f"epoch {e}"
    for step, loss in out[0]["losses"].items():
        assert loss == pytest.approx(base[step], rel=1e-6, abs=0), f"step {step}"
    assert sorted(out[0]["losses"]) == list(range(stop, STEPS))


def _first_reads(stop: int, epoch: int) -> list[int]:
    """The ids 2 ranks read of ``epoch`` in the first ``stop`` global batches."""
    from gangrun.data.sampler import epoch_order

    order = epoch_order(ef.N, ef.SEED, epoch, True)
    per = ef.N // ef.GLOBAL_BATCH
    done = max(0, min(stop - epoch * per, per))
    return order[: done * ef.GLOBAL_BATCH]


def _baseline(tmp_path) -> dict[int, float]:
    run = gangrun.distributed(processes=2, timeout=120, checkpoint_dir=str(tmp_path / "b"))
    out = run(ef.train).distributed("ddp", STEPS)
    return out[0]["losses"]
