"""gangrun.checkpoint.state: how a Checkpointer sorts a state mapping (no processes)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from gangrun.checkpoint import state as cs  # noqa: E402


def test_entries_are_sorted_by_how_they_are_saved():
    model = torch.nn.Linear(2, 2)
    other = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.Adam(model.parameters())
    loose = torch.optim.SGD([other], lr=0.1)  # over no module of the state: saved per rank
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    e = cs.classify(
        {"model": model, "opt": opt, "loose": loose, "sched": sched, "n": 3, "t": torch.ones(2)},
        rank=1,
    )
    assert list(e.models) == ["model"] and e.optims == {"opt": (opt, "model")}
    assert set(e.stateful) == {"loose", "sched"} and set(e.plain) == {"n", "t"}


@pytest.mark.parametrize("bad", [object(), lambda: 0, [1, object()]])
def test_an_entry_without_state_names_key_and_rank(bad):
    with pytest.raises(TypeError, match=r"on rank 3: state\['thing'\] is a .*no state to save"):
        cs.classify({"ok": 1, "thing": bad}, rank=3)


def test_reserved_and_non_string_keys_are_refused():
    for key in ("__gangrun_rank0", 3, ""):
        with pytest.raises(TypeError, match="bad state key"):
            cs.classify({key: 1}, rank=0)


def test_rng_round_trip_and_plain_values_back_into_the_mapping():
    import random

    import numpy as np

    model = torch.nn.Linear(2, 2)
    state = {"model": model, "n": 1}
    e = cs.classify(state, rank=0)
    sd = cs.save_dict(e, 0, {"step": 7})
    want = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    state["n"] = 99
    random.random(), np.random.rand(), torch.rand(1)  # move every generator on
    tpl = cs.load_template(e, 0)
    tpl[cs.BLOB.format(rank=0)] = sd[cs.BLOB.format(rank=0)]
    blob = cs.apply(e, tpl, 0, state)
    assert blob["step"] == 7 and state["n"] == 1
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == want


def test_preempted_ranks_become_one_error_with_the_resume_line(tmp_path):
    import json
    import pickle

    from gangrun import DistributedPreemptedError
    from gangrun.lifecycle.checkpoints import check_writable, preempted_error
    from gangrun.wire.rundir import RunDir

    rd = RunDir(str(tmp_path))
    assert preempted_error(rd, 2, "call1", "train") is None
    for r in (0, 1):
        rec = {"step": 12, "checkpoint": "s3://b/run/step-000000012", "mlflow_run_id": "abc"}
        (tmp_path / f"stop.{r}.json").write_text(json.dumps(rec))
    err = preempted_error(rd, 2, "call1", "train")
    assert isinstance(err, DistributedPreemptedError)
    assert err.step == 12 and err.checkpoint.endswith("step-000000012")
    assert err.resume == "train.options(run_id='abc').distributed(...)" and err.resume in str(err)
    back = pickle.loads(pickle.dumps(err))
    assert (back.step, back.resume, back.run_id) == (12, err.resume, "call1")
    check_writable(str(tmp_path / "new" / "dir"))  # created, probe written and removed
    assert list((tmp_path / "new" / "dir").iterdir()) == []
