"""Argument splitting and exit codes of the ``gangrun`` command."""

from __future__ import annotations

import pytest

from gangrun.cli.entry import _split_run, exit_code_for
from gangrun.errors import (
    DistributedCancelledError,
    DistributedError,
    DistributedTimeoutError,
    LaunchError,
)
from gangrun.options import ForkServerOptions, RayOptions


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["--processes", "2", "train.py", "--lr", "1"],
            (["--processes", "2"], ["train.py", "--lr", "1"], None),
        ),
        (
            ["--no-mlflow", "train.py", "--gpus", "3"],
            (["--no-mlflow"], ["train.py", "--gpus", "3"], None),
        ),
        (["--processes=2", "-m", "pkg.mod", "-x"], (["--processes=2"], ["-x"], "pkg.mod")),
        (["-mpkg.mod", "a"], ([], ["a"], "pkg.mod")),
        (["--env", "A=1", "--", "-weird.py"], (["--env", "A=1"], ["-weird.py"], None)),
    ],
)
def test_split_run(args, expected):
    assert _split_run(args) == expected


def test_exit_codes():
    assert exit_code_for(DistributedError("x", rank=1, exitcode=3)) == 3
    assert exit_code_for(DistributedError("x", rank=1, exitcode=-9)) == 137
    assert exit_code_for(DistributedError("x", rank=1, exitcode=256)) == 1
    assert exit_code_for(DistributedTimeoutError("t")) == 124
    assert exit_code_for(DistributedCancelledError("c")) == 130
    assert exit_code_for(LaunchError("l")) == 2
    assert exit_code_for(RuntimeError("?")) == 1


# ---------------------------------------------------------------- every flag reaches Options
import dataclasses  # noqa: E402

import gangrun  # noqa: E402
from gangrun import Options  # noqa: E402
from gangrun import defaults as _defaults  # noqa: E402
from gangrun.cli.entry import _parsers, main  # noqa: E402
from gangrun.cli.options import FLAGS, options_from_args, speak_cli  # noqa: E402

FLAG_CASES = [
    (["--gpus", "2"], "gpus", 2),
    (["--gpus", "0,3"], "gpus", [0, 3]),
    (["--processes", "3"], "processes", 3),
    (["--min-ranks", "2"], "min_ranks", 2),
    (["--nproc", "2"], "processes", 2),
    (["--gpu-type", "H100"], "gpu_type", "H100"),
    (["--timeout", "1h"], "timeout", 3600.0),
    (["--timeout", "90"], "timeout", 90.0),
    (["--timeout", "15m"], "timeout", 900.0),
    (["--timeout", "1h30m"], "timeout", 5400.0),
    (["--timeout", "none"], "timeout", None),
    (["--timeout", "0"], "timeout", None),
    (["--no-mlflow"], "mlflow", False),
    (["--mlflow"], "mlflow", True),
    (["--env", "A=1", "--env", "B=x=y"], "env", {"A": "1", "B": "x=y"}),
    (["--max-restarts", "2"], "max_restarts", 2),
    (["--restart-backoff", "0"], "restart_backoff", 0.0),
    (["--restart-backoff-max", "2m"], "restart_backoff_max", 120.0),
    (["--output", "rank0"], "output", "rank0"),
    (["--max-capture-bytes", "2GiB"], "max_capture_bytes", 2 << 30),
    (["--max-capture-bytes", "1000"], "max_capture_bytes", 1000),
    (["--grace-period", "30s"], "grace_period", 30.0),
    (["--log-dir", "logs"], "log_dir", "logs"),
    (["--start-method", "spawn"], "start_method", "spawn"),
    (["--backend", "ray"], "backend", "ray"),
    (["--address", "head:6379"], "address", "head:6379"),
    (["--ray", '{"ship": false}'], "ray", RayOptions(ship=False)),
    (["--forkserver", '{"start_timeout": 60}'], "forkserver", ForkServerOptions(start_timeout=60)),
    (["--system-metrics"], "log_system_metrics", True),
    (["--no-system-metrics"], "log_system_metrics", False),
    (["--hang-timeout", "2m"], "hang_timeout", 120.0),
    (["--no-progress"], "progress", False),
    (["--gpu-wait", "10m"], "gpu_wait", 600.0),
    (["--gpu-wait", "none"], "gpu_wait", None),
    (["--checkpoint-dir", "s3://b/run"], "checkpoint_dir", "s3://b/run"),
    (["--no-memory"], "memory", False),
    (["--memory-every", "5"], "memory_every", 5),
    (["--experiment-name", "exp"], "experiment_name", "exp"),
    (["--run-name", "nightly"], "run_name", "nightly"),
    (["--run-id", "0123abc"], "run_id", "0123abc"),
    (["--tag", "team=vision", "--tag", "n=a=b"], "tags", {"team": "vision", "n": "a=b"}),
]


@pytest.fixture
def no_defaults(monkeypatch):
    for f in dataclasses.fields(Options):
        monkeypatch.delenv(_defaults.env_var(f.name), raising=False)
    gangrun.reset_defaults()


@pytest.mark.parametrize(("argv", "option", "value"), FLAG_CASES)
def test_each_flag_reaches_the_options(argv, option, value, no_defaults):
    for parser in _parsers()[1:]:  # run and info take the same option flags
        ns = parser.parse_args(argv)
        explicit = options_from_args(ns)
        assert explicit[option] == value
        opts, sources = _defaults.resolve_with_sources(explicit)
        # an option group: its unset settings are resolved (built-in defaults here)
        want = value.with_builtins() if hasattr(value, "with_builtins") else value
        assert getattr(opts, option) == want
        assert sources[option] == "argument"
        assert set(explicit) == {option}  # flags not given stay to the defaults


def test_every_option_has_a_flag_with_help():
    run = _parsers()[1]
    helps = {a.dest: a.help for a in run._actions}
    fields = {f.name for f in dataclasses.fields(Options)}
    assert fields <= set(helps), fields - set(helps)
    assert all(helps[f] for f in fields)
    assert fields <= {c[1] for c in FLAG_CASES}  # and each one is exercised above
    assert set(FLAGS) <= {f.name for f in dataclasses.fields(Options)}


def test_timeout_soon_names_the_flag_with_run_usage(capsys):
    assert main(["run", "--processes", "2", "--timeout", "soon", "train.py"]) == 2
    err = capsys.readouterr().err
    assert "usage: gangrun run" in err
    assert "argument --timeout: 'soon' is not a duration" in err


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["run", "--processes", "2"], "give a script"),
        (["run", "--processes", "2", "no-such-script.py"], "no such script"),
        (
            ["run", "--processes", "x", "t.py"],
            "argument --processes/--nproc: 'x' is not an integer",
        ),
        (["run", "--gpus", "2", "--processes", "2", "t.py"], "not allowed with argument"),
        (["run", "--env", "NOEQUALS", "t.py"], "argument --env: takes KEY=VALUE"),
        (["run", "--output", "rank1", "t.py"], "argument --output: invalid choice"),
    ],
)
def test_run_errors_show_run_usage(argv, fragment, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: gangrun run"), err
    assert fragment in err


def test_option_value_errors_speak_cli(tmp_path, capsys, monkeypatch, no_defaults):
    script = tmp_path / "t.py"
    script.write_text("")
    assert main(["run", "--processes", "2", "--max-restarts", "-1", str(script)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: gangrun run") and "max_restarts must be >= 0" in err
    monkeypatch.setenv("GANGRUN_TIMEOUT", "soon")
    assert main(["run", "--processes", "2", str(script)]) == 2
    assert "gangrun: GANGRUN_TIMEOUT='soon': 'soon' is not a duration" in capsys.readouterr().err


def test_version_and_help_epilog(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"gangrun {gangrun.__version__}"
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-1].strip().startswith("gangrun run --help")
    assert "examples:" in out
    assert main(["run", "--help"]) == 0
    out = capsys.readouterr().out
    assert "examples:" in out and "--hang-timeout DURATION" in out and "--gpu-wait" in out


def test_split_run_knows_every_valued_flag():
    ours, theirs, _ = _split_run(["--gpu-wait", "5m", "--hang-timeout", "1m", "t.py", "--x"])
    assert ours == ["--gpu-wait", "5m", "--hang-timeout", "1m"] and theirs == ["t.py", "--x"]
    ours, theirs, _ = _split_run(["--no-system-metrics", "t.py"])
    assert ours == ["--no-system-metrics"] and theirs == ["t.py"]


@pytest.mark.parametrize(
    "python, cli",
    [
        (
            "No GPU was found on this node (checked NVML, nvidia-smi and torch). To run on CPU "
            "processes instead (gloo), pass processes=N, e.g. @distributed(processes=2).",
            "No GPU was found on this node (checked NVML, nvidia-smi and torch). To run on CPU "
            "processes instead (gloo), pass --processes N, e.g. --processes 2.",
        ),
        (
            "gpus=8 but this node has 2 visible GPU(s). Ask for at most gpus=2, or run on a "
            "bigger node (backend='ray').",
            "--gpus 8 but this node has 2 visible GPU(s). Ask for at most --gpus 2, or run on a "
            "bigger node (--backend ray).",
        ),
        (
            "gpus=[0, 3]: busy. Use gpu_wait=SECONDS (None: no limit).",
            "--gpus 0,3: busy. Use --gpu-wait SECONDS (none: no limit).",
        ),
        ("pass mlflow=False", "pass --no-mlflow"),
        ("env['MASTER_PORT']=1 stays", "env['MASTER_PORT']=1 stays"),
    ],
)
def test_speak_cli(python, cli):
    assert speak_cli(LaunchError(python)) == cli


def test_speak_cli_hook():
    err = LaunchError("use processes=2")
    err.cli_message = "say it your way"  # type: ignore[attr-defined]
    assert speak_cli(err) == "say it your way"
    assert str(err) == "use processes=2"  # the Python-facing message is unchanged


def test_no_gpu_note_from_the_cli_speaks_cli(tmp_path, capsys, monkeypatch, no_defaults):
    from gangrun.host import accelerators

    monkeypatch.setattr(accelerators, "detect", lambda: [])  # a node without GPUs
    script = tmp_path / "t.py"
    script.write_text("")
    assert main(["run", "--no-mlflow", str(script)]) == 2
    err = capsys.readouterr().err
    assert "--processes N, e.g. --processes 2" in err and "processes=N" not in err
