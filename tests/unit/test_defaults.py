"""Defaults outside code: GANGRUN_<OPTION> variables, set_defaults(), precedence (no processes)."""

from __future__ import annotations

import dataclasses
import json

import pytest

import gangrun
from gangrun import LaunchError, Options, distributed
from gangrun import defaults as d
from gangrun.options import ForkServerOptions, RayOptions

# One value per option, as text for GANGRUN_<OPTION>, and the value it must become. Every
# field of Options must be here (see test_every_option_has_an_env_case).
ENV_CASES = {
    "progress": ("0", False),
    "gpus": ("0,3", [0, 3]),
    "processes": ("3", 3),
    "gpu_type": ("H100", "H100"),
    "timeout": ("1h30m", 5400.0),
    "mlflow": ("no", False),
    "env": ('{"A": "1", "B": "x y"}', {"A": "1", "B": "x y"}),
    "max_restarts": ("2", 2),
    "min_ranks": ("2", 2),
    "restart_backoff": ("2.5", 2.5),
    "restart_backoff_max": ("5m", 300.0),
    "output": ("rank0", "rank0"),
    "max_capture_bytes": ("512MiB", 512 << 20),
    "grace_period": ("2.5", 2.5),
    "log_dir": ("/tmp/logs", "/tmp/logs"),
    "start_method": ("spawn", "spawn"),
    "backend": ("ray", "ray"),
    "address": ("head:6379", "head:6379"),
    # option groups: resolved with every setting at its default (built-in here)
    "ray": ('{"ship": false, "pip": ["x"]}', RayOptions(ship=False, pip=("x",)).with_builtins()),
    "forkserver": ('{"preload": ["json"]}', ForkServerOptions(preload=("json",)).with_builtins()),
    "log_system_metrics": ("true", True),
    "hang_timeout": ("90s", 90.0),
    "gpu_wait": ("none", None),
    "checkpoint_dir": ("s3://bucket/run", "s3://bucket/run"),
    "memory": ("off", False),
    "memory_every": ("10", 10),
    # tracking options (added by the tracking work): plain strings and a JSON dict
    "experiment_name": ("exp", "exp"),
    "run_name": ("nightly", "nightly"),
    "tags": ('{"team": "nlp"}', {"team": "nlp"}),
}


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    for f in dataclasses.fields(Options):
        monkeypatch.delenv(d.env_var(f.name), raising=False)
    gangrun.set_defaults()
    yield
    gangrun.reset_defaults()


def _noop() -> None:
    pass


def test_every_option_has_an_env_case():
    names = {f.name for f in dataclasses.fields(Options)} - set(d.NOT_FROM_ENV)
    assert names <= set(ENV_CASES), names - set(ENV_CASES)


@pytest.mark.parametrize("name", sorted(f.name for f in dataclasses.fields(Options)))
def test_each_env_variable_reaches_the_options(name, monkeypatch):
    if name in d.NOT_FROM_ENV:
        monkeypatch.setenv(d.env_var(name), "abc")
        assert name not in d.from_env()
        return
    text, want = ENV_CASES[name]
    monkeypatch.setenv(d.env_var(name), text)
    f = distributed(_noop)
    assert getattr(f.settings, name) == want
    opts, sources = d.resolve_with_sources({})
    assert sources[name] == f"env GANGRUN_{name.upper()}"


@pytest.mark.parametrize(
    "var, text, fragment",
    [
        ("GANGRUN_TIMEOUT", "soon", "GANGRUN_TIMEOUT='soon': 'soon' is not a duration"),
        ("GANGRUN_PROCESSES", "two", "GANGRUN_PROCESSES='two': 'two' is not an integer"),
        ("GANGRUN_PROCESSES", "0", "GANGRUN_PROCESSES='0': processes must be >= 1"),
        ("GANGRUN_MLFLOW", "maybe", "not a boolean: give 1/0, true/false or yes/no"),
        ("GANGRUN_ENV", "A=1", "GANGRUN_ENV='A=1': 'A=1' is not JSON"),
        ("GANGRUN_ENV", "[1]", "is not a JSON object"),
        ("GANGRUN_OUTPUT", "some", "GANGRUN_OUTPUT='some': output must be one of"),
        ("GANGRUN_GPUS", "0,x", "not a GPU count"),
        ("GANGRUN_GPUS", "1,1", "names a device twice"),
        ("GANGRUN_GRACE_PERIOD", "none", "grace_period cannot be none"),
        ("GANGRUN_MAX_CAPTURE_BYTES", "lots", "is not a size"),
    ],
)
def test_bad_env_values_name_the_variable(var, text, fragment, monkeypatch):
    monkeypatch.setenv(var, text)
    f = distributed(processes=1)(_noop)
    with pytest.raises(LaunchError) as info:
        f.submit()
    assert fragment in str(info.value)


def test_env_none_and_zero(monkeypatch):
    monkeypatch.setenv("GANGRUN_TIMEOUT", "none")
    monkeypatch.setenv("GANGRUN_HANG_TIMEOUT", "0")
    monkeypatch.setenv("GANGRUN_LOG_DIR", "None")
    o = distributed(_noop).settings
    assert (o.timeout, o.hang_timeout, o.log_dir) == (None, None, None)


def test_env_gpus_and_processes_both_set(monkeypatch):
    monkeypatch.setenv("GANGRUN_GPUS", "2")
    monkeypatch.setenv("GANGRUN_PROCESSES", "2")
    with pytest.raises(LaunchError, match="GANGRUN_GPUS and GANGRUN_PROCESSES are both set"):
        distributed(_noop).settings  # noqa: B018


def test_gangrun_run_id_is_not_an_option_default(monkeypatch):
    # every rank sees GANGRUN_RUN_ID (gangrun's own call id): never read as run_id=
    monkeypatch.setenv("GANGRUN_RUN_ID", "abc123")
    assert "run_id" not in d.from_env()


def test_precedence(monkeypatch):
    monkeypatch.setenv("GANGRUN_TIMEOUT", "100")
    monkeypatch.setenv("GANGRUN_MAX_RESTARTS", "1")
    monkeypatch.setenv("GANGRUN_OUTPUT", "none")
    plain = distributed(processes=1)(_noop)  # decorated before set_defaults: still applies
    given = distributed(processes=1, timeout=300)(_noop)
    gangrun.set_defaults(timeout=200, max_restarts=3)
    assert plain.settings.timeout == 200  # set_defaults > env
    assert plain.settings.max_restarts == 3
    assert plain.settings.output == "none"  # env > built-in
    assert plain.settings.grace_period == 5.0  # built-in
    assert given.settings.timeout == 300  # explicit argument > set_defaults
    assert given.options(timeout=400).settings.timeout == 400  # .options() replaces it
    assert plain.options(max_restarts=0).settings.max_restarts == 0  # .options() > set_defaults
    _, sources = d.resolve_with_sources(given._explicit)
    assert sources["timeout"] == "argument"
    assert sources["max_restarts"] == "set_defaults"
    assert sources["output"] == "env GANGRUN_OUTPUT"
    assert sources["grace_period"] == "built-in"
    gangrun.set_defaults()  # back to built-ins: the environment shows again
    assert plain.settings.timeout == 100


def test_world_choice_is_one_option(monkeypatch):
    monkeypatch.setenv("GANGRUN_GPUS", "4")
    assert distributed(processes=2)(_noop).settings.gpus is None  # processes= hides GANGRUN_GPUS
    gangrun.set_defaults(processes=3)
    o = distributed(_noop).settings
    assert (o.gpus, o.processes) == (None, 3)
    assert distributed(gpus=1)(_noop).settings.processes is None


def test_set_defaults_validates():
    with pytest.raises(LaunchError, match=r"'num_gpus' \(did you mean 'gpus'\?\)"):
        gangrun.set_defaults(num_gpus=2)
    with pytest.raises(LaunchError, match="set_defaults: timeout must be a positive number"):
        gangrun.set_defaults(timeout=-1)
    with pytest.raises(LaunchError, match="not both"):
        gangrun.set_defaults(gpus=1, processes=1)
    assert gangrun.set_defaults(processes=2, env=None) == {"processes": 2, "env": {}}
    gangrun.reset_defaults()
    assert d.session_defaults() == {}


@pytest.mark.parametrize(
    "kwargs, suggestion",
    [({"num_gpus": 2}, "gpus"), ({"proceses": 2}, "processes"), ({"timeuot": 5}, "timeout")],
)
def test_misspelled_option_suggests(kwargs, suggestion):
    with pytest.raises(LaunchError) as info:
        distributed(**kwargs)
    msg = str(info.value)
    assert f"did you mean {suggestion!r}" in msg
    assert "Valid options: " in msg and "max_restarts" in msg
    with pytest.raises(LaunchError, match=f"did you mean {suggestion!r}"):
        distributed(processes=1)(_noop).options(**kwargs)


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("90", 90),
        ("90s", 90),
        ("1.5", 1.5),
        ("15m", 900),
        ("2h", 7200),
        ("1h30m", 5400),
        ("1h0m30s", 3630),
        ("1h30", 5400),
        ("1m30", 90),
        ("2h30.5", 9030),
        (" 2H ", 7200),
        ("none", None),
    ],
)
def test_parse_duration(text, seconds):
    assert d.parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["soon", "", "-5", "5d", "h", "1m1h", "90s30", "nan", "1h30x"])
def test_parse_duration_rejects(text):
    with pytest.raises(ValueError, match="not a duration"):
        d.parse_duration(text)


def test_env_json_round_trip(monkeypatch):
    monkeypatch.setenv("GANGRUN_ENV", json.dumps({"NCCL_DEBUG": "INFO"}))
    gangrun.set_defaults(env={"X": "1"})
    assert dict(distributed(_noop).settings.env) == {"X": "1"}  # whole option, not merged


def test_an_option_refused_at_launch_names_where_its_value_came_from(monkeypatch, tmp_path, capsys):
    from gangrun.cli.entry import main

    fn = distributed(processes=1, mlflow=False)(_noop)
    monkeypatch.setenv("GANGRUN_MIN_RANKS", "1")
    with pytest.raises(LaunchError) as info:
        fn.submit()
    msg = str(info.value)
    assert msg.startswith("min_ranks=1 (from GANGRUN_MIN_RANKS) restarts a Ray call"), msg
    monkeypatch.delenv("GANGRUN_MIN_RANKS")
    gangrun.set_defaults(min_ranks=1)
    with pytest.raises(LaunchError, match=r"^min_ranks=1 \(from set_defaults\) restarts"):
        fn.submit()
    gangrun.reset_defaults()
    with pytest.raises(LaunchError, match=r"^min_ranks=1 restarts"):  # an argument: as written
        fn.options(min_ranks=1).submit()
    # one refused once the call acquires (the checkpoint location), from the environment
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("GANGRUN_CHECKPOINT_DIR", str(blocked / "ckpt"))
    with pytest.raises(LaunchError) as info:
        fn.submit()
    msg = str(info.value)
    assert f"checkpoint_dir={str(blocked / 'ckpt')!r} (from GANGRUN_CHECKPOINT_DIR)" in msg, msg
    monkeypatch.delenv("GANGRUN_CHECKPOINT_DIR")
    # gangrun run: a flag is named as the flag, a variable as the variable
    script = tmp_path / "train.py"
    script.write_text("print('never runs')\n")
    monkeypatch.setenv("GANGRUN_MIN_RANKS", "1")
    assert main(["run", "--processes", "1", str(script)]) != 0
    err = capsys.readouterr().err
    assert "gangrun: min_ranks=1 (from GANGRUN_MIN_RANKS) restarts" in err, err
    monkeypatch.delenv("GANGRUN_MIN_RANKS")
    assert main(["run", "--processes", "1", "--min-ranks", "1", str(script)]) != 0
    err = capsys.readouterr().err
    assert "gangrun: --min-ranks 1 restarts" in err and "(from" not in err, err
