"""Resume exactness, property-based: a training interrupted and continued ends with bitwise
the parameters, plain values and per-step losses (and batches) of the uninterrupted run.

A configuration (`Config`) is drawn from a seed over: how the run is interrupted (a rank
SIGKILLed and restarted by ``max_restarts``; the caller SIGKILLed, then a fresh call with
``run_id=`` or ``checkpoint_dir=``; SIGTERM to the caller, then the resume line its
``DistributedPreemptedError`` prints; ``handle.cancel(checkpoint=True)``, then its resume
line; two of these in one run), at which step (any; the draw favours the steps just before
and after a save and an epoch boundary), the loader (``VolumeDataset.loader()``,
``TableDataset.loader()``, the state holding the loader or its dataset; a plain shuffled
``DataLoader`` with its own generator behind a user's stateful wrapper), ``num_workers``
0-3, shuffle on/off, world size 1-3, ``every`` / ``every_seconds``, ``keep``, async or sync
saves, MLflow on or off. The training is
`resume_fns.train`; each rank traces every step it runs (replays too), and the test compares
every traced step, the final parameters and plain values, and (MLflow on) the run's loss
history, one entry per step, with an uninterrupted run of the same training (cached per
session).

DDP over 3 ranks: its first step after a restore all-reduces in the initial bucket layout,
which sums 3 gradients in another order (docs/long_runs.md, "Exactness, measured limits").
With 3 ranks the batches, epochs and plain values must still be identical; losses and
parameters are compared to ``resume_harness.TOL3`` (the caveat's last-bit differences,
carried a few steps).

Two tiers:

* ``test_covering``: a fixed list of configurations that holds every interruption kind,
  loader, worker count and world size (`test_covering_slice_covers_every_dimension`); part
  of the suite.
* ``test_resume_search``: ``GANGRUN_RESUME_RUNS`` configurations drawn from seeds
  ``GANGRUN_RESUME_SEED + i`` (``make soak-resume``); skipped when ``GANGRUN_RESUME_RUNS`` is
  unset. Every failure prints its configuration and the command that replays it alone::

    GANGRUN_RESUME_CONFIG='<json>' python -m pytest -s \
        tests/soak/test_resume_exactness.py::test_resume_search
"""

from __future__ import annotations

import os
import time

import pytest
import resume_fns

pytest.importorskip("torch")

from resume_harness import (  # noqa: E402
    KINDS,
    LOADERS,
    TOTAL,
    Config,
    Event,
    Session,
    check,
    draw,
)

import gangrun  # noqa: E402
from conftest import assert_no_survivors  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.mlflow]


@pytest.fixture(scope="session")
def resume_session(tmp_path_factory):
    return Session(tmp_path_factory)
    return Session(tmp_path_factory)


# ------------------------------------------------------------------------------ tier 1: CI
def _ev(kind: str, step: int, rank: int = 0, settle: bool = True) -> Event:
    return Event(kind, step, rank, settle)


COVERING = {
    # 2 workers, restored at an odd batch of epoch 1 (the next batch is the other worker's)
    "volume-w2-nw2-rankkill-odd": Config("volume", 2, True, 2, (_ev("rank_kill", 10, 1),), every=3),
    # the table's position with 3 workers, the state holding the dataset; the stop saves
    # step 9 (an odd batch of epoch 1); MLflow on: resumed by the run_id= resume line
    "table-w2-nw3-cancel-odd": Config(
        "table", 3, True, 2, (_ev("cancel", 8),), every=3, keep=1, mlflow=True, hold="dataset"
    ),
    # a plain DataLoader in the state as it is; SIGTERM to the caller at an epoch's last
    # step; sync saves; resumed by the checkpoint_dir= resume line
    "plain-w2-nw1-sigterm-epoch": Config(
        "plain", 1, True, 2, (_ev("sigterm", 5),), every=4, async_save=False
    ),
    # one rank, saves by time only, cancelled at an epoch's first step; in order
    "volume-w1-nw0-cancel-seconds": Config(
        "volume", 0, False, 1, (_ev("cancel", 6),), every=None, every_seconds=0.02
    ),
    # DDP over 3 ranks (the bucket caveat); the table's loader in the state; rank 2 killed
    # with a save in flight
    "table-w3-nw0-rankkill-unsettled": Config(
        "table", 0, True, 3, (_ev("rank_kill", 7, 2, settle=False),), every=2, keep=None
    ),
    # two interruptions in one call: a rank kill, then a cancel of the restarted gang
    "plain-w1-nw2-rankkill-cancel": Config(
        "plain", 2, True, 1, (_ev("rank_kill", 4), _ev("cancel", 10)), every=2
    ),
    # two across processes: the caller killed with a save in flight, resumed by run_id= in
    # a fresh process, whose rank 1 is then killed just after a save
    "volume-w2-nw1-callerkill-rankkill": Config(
        "volume",
        1,
        True,
        2,
        (_ev("caller_kill", 3, settle=False), _ev("rank_kill", 9, 1)),
        every=3,
        every_seconds=0.05,
        mlflow=True,
    ),
    # 3 workers, in order, sync saves, cancelled at an odd batch of epoch 1
    "volume-w2-nw3-cancel-sync": Config(
        "volume", 3, False, 2, (_ev("cancel", 7),), every=2, async_save=False
    ),
    # 3 workers, in order, 3 ranks, rank 1 killed at epoch 2's first step
    "plain-w3-nw3-rankkill-epoch": Config(
        "plain", 3, False, 3, (_ev("rank_kill", 12, 1),), every=5
    ),
    # the table, one worker, one rank, the caller killed, resumed with checkpoint_dir=
    "table-w1-nw1-callerkill-dir": Config(
        "table",
        1,
        True,
        1,
        (_ev("caller_kill", 10),),
        every=None,
        every_seconds=0.02,
        hold="dataset",
    ),
}


def test_draws_are_reproducible_and_well_formed():
    cfgs = [draw(seed) for seed in range(2000)]
    for c in cfgs:
        assert c == draw(c.seed) and Config.from_json(c.to_json()) == c
        steps = [e.step for e in c.events]
        assert steps == sorted(steps) and all(0 <= s < c.total for s in steps), c
        if len(steps) == 2 and c.events[0].kind in ("sigterm", "cancel"):
            assert steps[1] > steps[0], c  # the preemption saved the step after it
        assert c.every or c.every_seconds, c
    assert {e.kind for c in cfgs for e in c.events} == set(KINDS)
    assert {(c.loader, c.workers, c.world) for c in cfgs} == {
        (ld, nw, w) for ld in LOADERS for nw in range(4) for w in (1, 2, 3)
    }
    assert {e.step for c in cfgs for e in c.events} == set(range(TOTAL))


def test_covering_slice_covers_every_dimension():
    cfgs = list(COVERING.values())
    assert {e.kind for c in cfgs for e in c.events} == set(KINDS)
    assert {c.loader for c in cfgs} == set(LOADERS)
    assert {c.workers for c in cfgs} == {0, 1, 2, 3}
    assert {c.world for c in cfgs} == {1, 2, 3}
    assert {c.shuffle for c in cfgs} == {True, False}
    assert {c.async_save for c in cfgs} == {True, False}
    assert {c.mlflow for c in cfgs} == {True, False}
    assert any(len(c.events) == 2 for c in cfgs)
    assert {c.hold for c in cfgs if c.loader != "plain"} == {"loader", "dataset"}
    assert any(c.every is None for c in cfgs) and any(c.every_seconds for c in cfgs)
    for c in cfgs:
        assert Config.from_json(c.to_json()) == c


@pytest.mark.parametrize("name", list(COVERING))
def test_covering(name, resume_session, tmp_path, script):
    got = check(COVERING[name], resume_session, tmp_path, script)
    print(got.report())  # the seconds it took, shown with -s
    assert not got.problems, got.report()


def test_plain_dataloader_shuffled_by_the_global_generator_is_refused(tmp_path):
    """A plain ``DataLoader`` is resumed exactly when it has a generator of its own (the
    configurations above put one in the state as it is); one that shuffles with torch's
    global generator cannot be, and is refused naming the fix."""
    fn = gangrun.distributed(processes=1, timeout=120, mlflow=False)(
        resume_fns.plain_loader_in_state
    )
    with pytest.raises(gangrun.DistributedError) as info:
        fn.distributed(str(tmp_path / "ckpt"))
    assert "state['loader'] is a DataLoader" in str(info.value)
    assert "generator=torch.Generator()" in str(info.value)


# ------------------------------------------------------------------------------ tier 2: soak
RUNS = int(os.environ.get("GANGRUN_RESUME_RUNS") or 0)
SEED = int(os.environ.get("GANGRUN_RESUME_SEED") or 20281)
REPLAY = os.environ.get("GANGRUN_RESUME_CONFIG")


@pytest.mark.soak
@pytest.mark.timeout(300 + 90 * max(RUNS, 1))
def test_resume_search(resume_session, tmp_path, script, capsys):
    if REPLAY:
        cfgs = [Config.from_json(REPLAY)]
    elif RUNS:
        cfgs = [draw(SEED + i) for i in range(RUNS)]
    else:
        pytest.skip("set GANGRUN_RESUME_RUNS (make soak-resume) or GANGRUN_RESUME_CONFIG")
    failures: list[str] = []
    t0 = time.monotonic()
    for i, cfg in enumerate(cfgs):
        got = check(cfg, resume_session, tmp_path / f"c{i}", script)
        try:
            assert_no_survivors(wait=10.0)
        except AssertionError as exc:
            got.problems.append(str(exc))
        with capsys.disabled():
            if got.problems:
                failures.append(got.report())
                print(f"\nFAILED {failures[-1]}", flush=True)
            else:
                print(f"\nok [{got.base_s:.1f} s + {got.run_s:.1f} s] {cfg.describe()}", flush=True)
            if (i + 1) % 25 == 0:
                print(
                    f"resume search: {i + 1} runs, {len(failures)} failed, "
                    f"{time.monotonic() - t0:.0f} s",
                    flush=True,
                )
        if failures and os.environ.get("GANGRUN_RESUME_FIRST_FAILURE"):
            break
    with capsys.disabled():
        print(
            f"\nresume search: base seed {SEED}, {len(cfgs)} runs in "
            f"{time.monotonic() - t0:.0f} s, {len(failures)} failed"
        )
    assert not failures, f"{len(failures)} of {len(cfgs)} configurations (seed {SEED}):\n" + (
        "\n".join(failures[:20])
    )
