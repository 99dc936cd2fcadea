"""What the Checkpointer promises a training written as users write it: everything in the state mapping is saved as it is at save time, ranks never share a
state without a process group, a loop left early loses no metric, every rank may log the
same metrics and each step is in the run once, and bad arguments are named when it is made.
"""

from __future__ import annotations

import os

import pytest

import gangrun

torch = pytest.importorskip("torch")


# ---------------------------------------------------------------------- in this process
def _plain_run(where: str, steps: int, kill_after: int | None = None) -> dict:
    state: dict = {"epoch": 0, "hist": [], "w": torch.zeros(2)}
    ckpt = gangrun.Checkpointer(state, every=2, dir=where, async_save=False)
    for step in ckpt.steps(steps):
        state["epoch"] = step // 3  # reassigned: a new int object each time
        state["hist"] = state["hist"] + [step]  # a new list
        state["best"] = -float(step)  # a key added after the manager was made
        state["w"] = state["w"] + 1  # a new tensor
        if kill_after is not None and step == kill_after:
            break
    return state


def test_plain_values_are_saved_as_they_are_at_save_time(tmp_path):
    where = str(tmp_path / "ckpt")
    straight = _plain_run(str(tmp_path / "straight"), 7)
    _plain_run(where, 7, kill_after=4)  # saved at steps 2 and 4: 4 steps done
    fresh: dict = {"epoch": 0, "hist": [], "w": torch.zeros(2)}
    ckpt = gangrun.Checkpointer(fresh, every=2, dir=where, async_save=False)
    assert ckpt.restore() == 4
    assert fresh["epoch"] == 1 and fresh["hist"] == [0, 1, 2, 3] and fresh["best"] == -3.0
    assert torch.equal(fresh["w"], torch.full((2,), 4.0))
    ckpt.close()
    resumed = _plain_run(where, 7)
    assert resumed["hist"] == straight["hist"] and resumed["epoch"] == straight["epoch"]
    assert resumed["best"] == straight["best"] and torch.equal(resumed["w"], straight["w"])


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"every_seconds": -5}, ValueError, "every_seconds must be a number of seconds > 0"),
        ({"every_seconds": 0}, ValueError, "every_seconds must be a number of seconds > 0"),
        ({"every_seconds": "10"}, TypeError, "every_seconds must be a number .* got '10' \\(str"),
        ({"every_seconds": float("nan")}, ValueError, "every_seconds"),
        ({"every_seconds": True}, TypeError, "every_seconds"),
        ({"every": 0}, ValueError, "every must be an integer >= 1"),
        ({"keep": 1.5}, ValueError, "keep must be an integer >= 1"),
        ({"async_save": "yes"}, TypeError, "async_save must be True or False"),
        ({"storage_options": "anon"}, TypeError, "storage_options must be a dict"),
        ({"dir": 5}, TypeError, "dir must be a path or URL string"),
    ],
)
def test_arguments_are_checked_when_the_manager_is_made(tmp_path, kwargs, error, text):
    kwargs = {"dir": str(tmp_path / "c"), **kwargs}
    with pytest.raises(error, match=f"Checkpointer on rank 0: {text}"):
        gangrun.Checkpointer({"w": torch.zeros(1)}, **kwargs)
    with pytest.raises(TypeError, match="the state must be a dict"):
        gangrun.Checkpointer([torch.zeros(1)], dir=str(tmp_path / "c"))  # type: ignore[arg-type]


# ---------------------------------------------------------------------- real ranks
def no_process_group(where: str) -> int:
    ckpt = gangrun.Checkpointer({"rank": int(os.environ["RANK"])}, dir=where)
    return ckpt.restore()


def test_several_ranks_without_a_process_group_are_refused(tmp_path):
    where = tmp_path / "ckpt"
    fn = gangrun.distributed(processes=2, timeout=120)(no_process_group)
    with pytest.raises(gangrun.DistributedError) as info:
        fn.distributed(str(where))
    text = str(info.value)
    assert "torch.distributed is not initialised" in text and "init_process_group()" in text
    assert f"on rank {info.value.rank} of 2" in text
    assert not where.exists() or not any(where.iterdir())  # nothing was written


def log_on_every_rank(total: int, stop_at: int | None) -> int:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    w = torch.zeros(1)
    ckpt = gangrun.Checkpointer({"w": w}, every=5)
    for step in ckpt.steps(total):
        w += 1
        ckpt.log_metrics({"loss": float(step) * 10, "lr": 0.5}, step)  # as the docs show
        if step == stop_at:
            break  # early stopping: steps 10-12 are after the last save (step 10)
    return ckpt.step


def _history(run_id: str, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    return sorted((m.step, m.value) for m in MlflowClient().get_metric_history(run_id, key))


@pytest.mark.mlflow
def test_every_rank_logs_each_step_once_and_a_loop_left_early_loses_none(tmp_path):
    fn = gangrun.distributed(processes=2, timeout=180, checkpoint_dir=str(tmp_path / "c"))
    train = fn(log_on_every_rank)
    handle = train.submit(100, 12)
    handle.result()
    run_id = handle.mlflow_run_id
    assert _history(run_id, "loss") == [(s, s * 10.0) for s in range(13)]
    assert _history(run_id, "lr") == [(s, 0.5) for s in range(13)]
    # resumed from the step-10 checkpoint, the run redoes steps 10-12: still once each
    train.options(run_id=run_id).distributed(16, None)
    assert _history(run_id, "loss") == [(s, s * 10.0) for s in range(16)]


def test_a_tracking_error_does_not_stop_the_training_and_keeps_the_metrics(
    tmp_path, monkeypatch, capfd
):
    # a run the store does not have: every MLflow call for it fails
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    monkeypatch.setenv("MLFLOW_RUN_ID", "0" * 32)
    ckpt = gangrun.Checkpointer({"w": torch.zeros(1)}, every=2, dir=str(tmp_path / "c"))
    for step in ckpt.steps(5):
        ckpt.log_metrics({"loss": float(step)}, step)
    assert "could not log" in capfd.readouterr().err
    assert sorted(s for s, _, _ in ckpt._step_metrics.buffered) == [0, 1, 2, 3, 4]  # kept
