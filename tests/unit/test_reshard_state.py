"""A checkpoint saved by N ranks restored on M (gangrun.checkpoint.state, Checkpointer.restore):
the per-rank blob rule (new rank r takes old rank r mod N's), the saved world size read from
the checkpoint, the line said on rank 0, and a DeepSpeed engine refused before anything is
loaded. Real checkpoint files in one process; the N saving ranks' blobs are made by the same
code each rank runs (``save_dict``)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import gangrun  # noqa: E402
from gangrun import checkpoint  # noqa: E402
from gangrun.checkpoint import state as cs  # noqa: E402
from gangrun.data import DistributedSampler  # noqa: E402


def _saved_by(n: int, root: str, step: int = 5) -> dict[int, tuple]:
    """A checkpoint of ``step`` as ``n`` ranks would save it: each rank's blob (its plain
    value, its RNG state, its loader's position) under its own key. Returns what each rank
    saved: (plain value, the next torch random number after the save)."""
    sd, want = {}, {}
    for r in range(n):
        torch.manual_seed(1000 + r)
        ds = TensorDataset(torch.arange(24))
        loader = DataLoader(ds, batch_size=6 // n, sampler=DistributedSampler(ds, n, r, seed=3))
        loader.sampler.set_epoch(2)
        state = {"who": f"rank{r}", "loader": loader}
        e = cs.classify(state, r)
        it = iter(loader)
        next(it), next(it)  # 2 global batches of 6 samples
        sd.update(cs.save_dict(e, r, {"step": step, "metrics": []}))
        want[r] = (f"rank{r}", float(torch.rand(1)))
    checkpoint.save(sd, f"{root}/step-{step:09d}")
    return want


@pytest.mark.parametrize(("old", "new"), [(2, 1), (2, 3), (3, 2)])
def test_new_rank_r_takes_old_rank_r_mod_n(tmp_path, old, new):
    root = str(tmp_path / "ckpt")
    want = _saved_by(old, root)
    assert cs.saved_world(checkpoint.latest(root)) == old
    for r in range(new):
        ds = TensorDataset(torch.arange(24))
        loader = DataLoader(ds, batch_size=6 // new, sampler=DistributedSampler(ds, new, r, seed=3))
        state = {"who": None, "loader": loader}
        e = cs.classify(state, r)
        tpl = cs.load_template(e, r, old)
        checkpoint.load(tpl, checkpoint.latest(root))
        blob = cs.apply(e, tpl, r, state, saved=old)
        assert blob["step"] == 5
        assert (state["who"], float(torch.rand(1))) == want[r % old]  # value and RNG stream
        # the position is global: the same in every blob, continued by the new split
        assert loader.sampler.resume_point == (2, 12)


def test_restore_onto_another_size_says_so_and_refuses_a_deepspeed_engine(tmp_path, capsys):
    root = str(tmp_path / "ckpt")
    _saved_by(2, root)
    ds = TensorDataset(torch.arange(24))
    loader = DataLoader(ds, batch_size=6, sampler=DistributedSampler(ds, 1, 0, seed=3))
    model = torch.nn.Linear(2, 1)
    ckpt = gangrun.Checkpointer({"loader": loader, "who": None}, dir=root)
    assert ckpt.restore() == 5 and ckpt.state["who"] == "rank0"
    err = capsys.readouterr().err
    assert (
        "gangrun: resumed step 5 saved by 2 ranks onto 1: data at global sample 12 of epoch 2"
        in err
    )
    loader.sampler.set_epoch(2)
    assert len(list(loader)) == 2  # the 12 samples of epoch 2 the 2 ranks had not read
    ckpt.close()

    class Engine:  # what classify takes for a DeepSpeed engine: its module and save API
        loaded = False

        def save_checkpoint(self, *a, **k):
            raise AssertionError("not saved here")

        def load_checkpoint(self, *a, **k):
            Engine.loaded = True
            return None, None

    Engine.__module__ = "deepspeed.runtime.engine"
    ckpt = gangrun.Checkpointer({"engine": Engine(), "model": model}, dir=root)
    with pytest.raises(RuntimeError) as info:
        ckpt.restore()
    text = str(info.value)
    assert "saved by 2 ranks and this call has 1" in text and "ds_to_universal" in text
    assert "--input_folder " + root in text and "Resume on 2 ranks" in text
    assert not Engine.loaded  # refused before anything is loaded
