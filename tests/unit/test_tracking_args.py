"""MLflow options checked before anything starts, parameter names, CLI flags (no processes)."""

from __future__ import annotations

import pytest

from conftest import run_python
from gangrun import LaunchError, distributed
from gangrun.cli.entry import _parser, _split_run
from gangrun.cli.options import options_from_args
from gangrun.tracking import call_arguments
from gangrun.tracking.plan import resolve_log_system_metrics


def _noop() -> int:
    return 1


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"experiment_name": ""}, "experiment_name must be a non-empty string"),
        ({"experiment_name": "  "}, "experiment_name must be a non-empty string"),
        ({"experiment_name": 7}, "experiment_name must be a non-empty string or None, got 7"),
        ({"run_name": 123}, "run_name must be a non-empty string"),
        ({"run_name": ""}, "run_name must be a non-empty string"),
        ({"run_id": ""}, "run_id must be a non-empty string"),
        ({"tags": {"team": 1}}, r"tags must map non-empty str keys to str values; got 'team': 1"),
        ({"tags": {1: "x"}}, "tags must map non-empty str keys"),
        ({"tags": {"": "x"}}, "tags must map non-empty str keys"),
        ({"tags": ["a"]}, "tags must be a dict of str to str"),
        ({"log_system_metrics": "yes"}, "log_system_metrics must be True, False or None"),
        ({"run_id": "abc", "mlflow": False}, "mlflow=False turns tracking off"),
    ],
)
def test_bad_mlflow_options(kwargs, fragment):
    with pytest.raises(LaunchError, match=fragment):
        distributed(processes=1, **kwargs)(_noop)
    with pytest.raises(LaunchError, match=fragment):
        distributed(processes=1)(_noop).options(**kwargs)


@pytest.mark.mlflow  # run_id= needs tracking on
def test_good_mlflow_options():
    f = distributed(processes=1, experiment_name="e", run_name="r", run_id="abc", tags={"k": "v"})(
        _noop
    )
    s = f.settings
    assert (s.experiment_name, s.run_name, s.run_id, dict(s.tags)) == ("e", "r", "abc", {"k": "v"})
    assert distributed(processes=1, tags=None)(_noop).settings.tags == {}
    assert s.log_system_metrics is None


def _fn(lr, epochs=3, *rest, flag=True, **extra):
    return lr


@pytest.mark.parametrize(
    "args, kwargs, expected",
    [
        ((0.5,), {}, {"lr": 0.5, "epochs": 3, "flag": True}),
        ((0.5, 7), {"flag": False}, {"lr": 0.5, "epochs": 7, "flag": False}),
        (
            (0.1, 2, "a", [1, 2], 4),
            {"beta": 0.9, "data": object()},
            {"lr": 0.1, "epochs": 2, "rest.0": "a", "rest.2": 4, "flag": True, "beta": 0.9},
        ),
        (([1, 2],), {}, {"epochs": 3, "flag": True}),  # non-scalars are left out
    ],
)
def test_call_arguments_by_parameter_name(args, kwargs, expected):
    assert call_arguments(_fn, args, kwargs) == expected


def test_call_arguments_without_a_signature():
    # arguments that do not bind (the call fails in the ranks anyway) still never say arg0
    assert call_arguments(_noop, (1, "x"), {"k": 2}) == {"args.0": 1, "args.1": "x", "k": 2}
    assert call_arguments(max, (1, 2), {}) in ({"args.0": 1, "args.1": 2}, {})


@pytest.mark.parametrize(
    "opt, processes, expected",
    [(None, None, True), (None, 2, False), (False, None, False), (True, 2, True)],
)
def test_system_metrics_default_follows_gpus(opt, processes, expected):
    from gangrun.api import Options

    o = Options(processes=processes, log_system_metrics=opt)
    assert resolve_log_system_metrics(o, processes) is expected


def test_cli_flags_map_to_options():
    ns = _parser().parse_args(
        [
            "run",
            "--processes",
            "2",
            "--experiment-name",
            "exp",
            "--run-name",
            "nightly",
            "--run-id",
            "0123abc",
            "--tag",
            "team=vision",
            "--tag",
            "note=a=b",
            "train.py",
        ]
    )
    assert (ns.experiment_name, ns.run_name, ns.run_id) == ("exp", "nightly", "0123abc")
    assert options_from_args(ns)["tags"] == {"team": "vision", "note": "a=b"}
    with pytest.raises(SystemExit):
        _parser().parse_args(["run", "--tag", "novalue", "train.py"])
    ours, theirs, _ = _split_run(["--tag", "a=b", "--run-id", "x", "train.py", "--tag", "c"])
    assert (ours, theirs) == (["--tag", "a=b", "--run-id", "x"], ["train.py", "--tag", "c"])
    help_text = _parser()._subparsers._group_actions[0].choices["run"].format_help()  # type: ignore[union-attr]
    for flag in ("--experiment-name", "--run-name", "--run-id", "--tag KEY=VALUE"):
        assert flag in help_text


def test_rank_side_imports_nothing_of_the_caller_side():
    code = (
        "import sys, gangrun.rank.tracking as r; r.RankRuns().end(True); "
        "bad = [m for m in ('mlflow', 'gangrun.tracking.caller', 'gangrun.tracking.plan') "
        "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    out = run_python(code)
    assert out.returncode == 0, out.stdout + out.stderr
