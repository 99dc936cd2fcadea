"""Every setting in `gangrun.Options`: each one a typed field whose
variable is read once, as its default, when the call's options are resolved; its source
shown by ``gangrun info``; a failed fork-server start retried after a back-off.

No processes here (the fork server's real boot failure is in tests/system/test_forkserver.py).
"""

from __future__ import annotations

import dataclasses
import json

import pytest

import gangrun
from gangrun import LaunchError
from gangrun import defaults as d
from gangrun.launch import GangSpec, RankSpec
from gangrun.launch.forkserver.client import RETRY_FIRST_S, RETRY_MAX_S, Registry
from gangrun.launch.gang import start_method
from gangrun.options import ForkServerOptions, Options, RayOptions, settings_of
from gangrun.wire import contract

GROUP_VARS = [
    m["env"]
    for g in (RayOptions, ForkServerOptions)
    for m in settings_of(g).values()  # type: ignore[arg-type]
]


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    for f in dataclasses.fields(Options):
        monkeypatch.delenv(d.env_var(f.name), raising=False)
    for var in [*GROUP_VARS, *contract.SETTINGS]:
        monkeypatch.delenv(var, raising=False)
    gangrun.reset_defaults()
    yield
    gangrun.reset_defaults()


# ------------------------------------------------------------------------- start_method
def _spec(method: str) -> GangSpec:
    return GangSpec("x", "/tmp", [RankSpec(0, {})], "/tmp", start_method=method)


def test_an_explicit_auto_start_method_wins_over_the_environment(monkeypatch):
    """Regression: GANGRUN_START_METHOD was read again at launch when the option was
    "auto", so an explicit start_method="auto" lost to the environment."""
    monkeypatch.setenv(contract.START_METHOD, "spawn")
    opts, sources = d.resolve_with_sources({"start_method": "auto"})
    assert (opts.start_method, sources["start_method"]) == ("auto", "argument")
    assert start_method(_spec(opts.start_method)) == "auto"  # not re-read at launch
    opts, sources = d.resolve_with_sources({})  # not given: the variable is its default
    assert (opts.start_method, sources["start_method"]) == ("spawn", "env GANGRUN_START_METHOD")
    assert start_method(_spec(opts.start_method)) == "spawn"


# ------------------------------------------------------------------------ option groups
def test_group_settings_come_from_their_variables_once(monkeypatch):
    monkeypatch.setenv(contract.RAY_STRATEGY, "spread")
    monkeypatch.setenv(contract.RAY_PLACEMENT_TIMEOUT, "5m")
    monkeypatch.setenv(contract.RAY_FORWARD_ENV, "A, B,")
    monkeypatch.setenv(contract.RAY_RUNTIME_ENV, '{"pip": ["x"]}')
    monkeypatch.setenv(contract.PRELOAD, "torch, json")
    monkeypatch.setenv(contract.FORKSERVER_START_TIMEOUT, "90")
    opts, sources = d.resolve_with_sources({})
    assert opts.ray.strategy == "SPREAD"
    assert opts.ray.placement_timeout == 300.0
    assert opts.ray.forward_env == ("A", "B")
    assert opts.ray.runtime_env == {"pip": ["x"]}
    assert opts.forkserver == ForkServerOptions(preload=("torch", "json"), start_timeout=90.0)
    for key, var in [
        ("ray.strategy", contract.RAY_STRATEGY),
        ("ray.placement_timeout", contract.RAY_PLACEMENT_TIMEOUT),
        ("ray.forward_env", contract.RAY_FORWARD_ENV),
        ("ray.runtime_env", contract.RAY_RUNTIME_ENV),
        ("forkserver.preload", contract.PRELOAD),
        ("forkserver.start_timeout", contract.FORKSERVER_START_TIMEOUT),
    ]:
        assert sources[key] == f"env {var}"
    # resolved once: a later change of the environment does not reach these options
    monkeypatch.setenv(contract.RAY_STRATEGY, "PACK")
    assert opts.ray.strategy == "SPREAD"


def test_group_settings_precedence(monkeypatch):
    monkeypatch.setenv(contract.RAY_STRATEGY, "SPREAD")
    monkeypatch.setenv(contract.PRELOAD, "none")
    opts, sources = d.resolve_with_sources({})
    assert opts.forkserver.preload == ()  # "none": nothing preloaded
    # an explicit group field wins over its variable, even at the built-in value
    explicit = {"ray": RayOptions(strategy="PACK"), "forkserver": {"preload": ["torch"]}}
    opts, sources = d.resolve_with_sources(explicit)
    assert opts.ray.strategy == "PACK" and sources["ray.strategy"] == "argument"
    assert opts.forkserver.preload == ("torch",) and sources["forkserver.preload"] == "argument"
    # ...the fields it leaves unset still come from the variables / built-ins
    assert sources["ray.placement_timeout"] == "built-in"
    assert opts.ray.placement_timeout == 300.0
    gangrun.set_defaults(ray={"strategy": "STRICT_PACK"})
    opts, sources = d.resolve_with_sources({})
    assert (opts.ray.strategy, sources["ray.strategy"]) == ("STRICT_PACK", "set_defaults")
    gangrun.reset_defaults()
    # the variable given in the call's env= option (as Ray users did) counts before os.environ
    opts, sources = d.resolve_with_sources({"env": {contract.RAY_STRATEGY: "STRICT_SPREAD"}})
    assert opts.ray.strategy == "STRICT_SPREAD"
    assert sources["ray.strategy"] == f"env option {contract.RAY_STRATEGY}"
    # the whole group from its own variable (JSON), a field of it from its variable
    monkeypatch.setenv(d.env_var("ray"), '{"ship": false}')
    opts, sources = d.resolve_with_sources({})
    assert opts.ray.ship is False and sources["ray"] == "env GANGRUN_RAY"
    assert sources["ray.strategy"] == "env GANGRUN_RAY_STRATEGY"


def test_built_in_group_settings():
    opts, sources = d.resolve_with_sources({})
    assert opts.ray == RayOptions(strategy="PACK", placement_timeout=300.0, forward_env=())
    assert opts.forkserver == ForkServerOptions(preload=("torch",), start_timeout=300.0)
    assert all(sources[f"ray.{k}"] == "built-in" for k in settings_of(RayOptions))
    # an Options never resolved (built directly) reads no variable: built-ins on use
    assert Options().ray.with_builtins().strategy == "PACK"


@pytest.mark.parametrize(
    "var, text, fragment",
    [
        (contract.RAY_STRATEGY, "diagonal", "ray.strategy must be one of"),
        (contract.RAY_PLACEMENT_TIMEOUT, "soon", "'soon' is not a duration"),
        (contract.RAY_PLACEMENT_TIMEOUT, "0", "give a positive duration"),
        (contract.RAY_RUNTIME_ENV, "[1]", "give a JSON object"),
        (contract.RAY_RUNTIME_ENV, "{", "GANGRUN_RAY_RUNTIME_ENV='{'"),
        (contract.FORKSERVER_START_TIMEOUT, "none", "give a positive duration"),
    ],
)
def test_bad_group_settings_name_their_variable(var, text, fragment, monkeypatch):
    monkeypatch.setenv(var, text)
    with pytest.raises(LaunchError) as info:
        d.resolve({})
    assert var in str(info.value) and fragment in str(info.value)


def test_bad_group_fields_in_code():
    with pytest.raises(LaunchError, match="forkserver.preload must be a list of module names"):
        Options(forkserver=ForkServerOptions(preload=(1,))).validate()  # type: ignore[arg-type]
    with pytest.raises(LaunchError, match="ray.placement_timeout must be a positive number"):
        Options(ray={"placement_timeout": -1}).validate()
    with pytest.raises(LaunchError, match="forkserver: unknown field"):
        Options(forkserver={"preloads": ["x"]}).validate()


def test_the_ray_planner_reads_the_resolved_group(monkeypatch):
    from gangrun.lifecycle.ray_plan import runtime_env_of

    monkeypatch.setenv(contract.RAY_RUNTIME_ENV, '{"env_vars": {"A": "1"}}')
    opts = d.resolve({"ray": {"env_vars": {"B": "2"}}})
    monkeypatch.delenv(contract.RAY_RUNTIME_ENV)  # read once, at resolution
    assert runtime_env_of(opts) == {"env_vars": {"A": "1", "B": "2"}}


# ------------------------------------------------------------------------ gangrun info
def test_info_shows_every_setting_and_its_source(monkeypatch, capsys):
    from gangrun.cli.entry import main

    monkeypatch.setenv(contract.RAY_STRATEGY, "SPREAD")
    monkeypatch.setenv(contract.SLOW_AFTER, "30")
    monkeypatch.setenv(contract.START_METHOD, "spawn")
    argv = ["info", "--processes", "1", "--forkserver", '{"start_timeout": 20}']
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    opts = report["options"]
    assert set(f.name for f in dataclasses.fields(Options)) <= set(opts)
    assert opts["start_method"] == {"value": "spawn", "source": "env GANGRUN_START_METHOD"}
    ray = opts["ray"]["fields"]
    assert ray["strategy"] == {"value": "SPREAD", "source": "env GANGRUN_RAY_STRATEGY"}
    assert ray["placement_timeout"] == {"value": 300.0, "source": "built-in"}
    fs = opts["forkserver"]["fields"]
    assert fs["start_timeout"] == {"value": 20, "source": "argument"}
    assert fs["preload"] == {"value": ["torch"], "source": "built-in"}
    assert set(report["settings"]) == set(contract.SETTINGS)
    assert report["settings"][contract.SLOW_AFTER] == {
        "value": "30",
        "source": "env " + contract.SLOW_AFTER,
    }
    assert report["settings"][contract.LOG_LEVEL]["source"] == "built-in"
    assert main(argv) == 0
    text = capsys.readouterr().out
    for row in (
        "ray.strategy",
        "forkserver.preload",
        "forkserver.start_timeout",
        contract.SLOW_AFTER,
    ):
        line = next(ln for ln in text.splitlines() if ln.split()[:1] == [row])
        assert line.split()[-1] in (
            "built-in",
            "argument",
            "GANGRUN_RAY_STRATEGY",
            contract.SLOW_AFTER,
        )


def test_info_shows_a_rejected_setting_beside_the_value_in_force(monkeypatch, capsys):
    """An unusable value is not listed as in force: the value in force is the default, the
    rejected value and why are beside it, and ``info --check`` fails on them."""
    from gangrun.cli.entry import main
    from gangrun.lifecycle import watch
    from gangrun.tracking import bounded

    bad = {
        contract.SLOW_AFTER: "abc",
        contract.TRACKING_TIMEOUT: "soon",
        contract.LOG_LEVEL: "LOUD",
    }
    for var, raw in bad.items():
        monkeypatch.setenv(var, raw)
    monkeypatch.setenv(contract.SILENT_AFTER, "90s")  # a good one, for contrast
    argv = ["info", "--processes", "1"]
    assert main([*argv, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["settings"]
    for var, raw in bad.items():
        default = contract.SETTINGS[var][0]
        assert rows[var]["value"] == default and rows[var]["source"] == "built-in", rows[var]
        assert rows[var]["rejected"]["value"] == raw and rows[var]["rejected"]["why"]
    assert rows[contract.SILENT_AFTER] == {"value": "90s", "source": "env GANGRUN_SILENT_AFTER"}
    assert watch.slow_after() == 60.0 and bounded.timeout_s() == 60.0  # what is in force
    assert watch.silent_after() == 90.0
    assert main(argv) == 0
    text = capsys.readouterr().out
    line = next(ln for ln in text.splitlines() if ln.split()[:1] == [contract.SLOW_AFTER])
    assert '"60"' in line and "built-in" in line, line
    assert 'GANGRUN_SLOW_AFTER="abc" rejected: not a duration' in line, line
    assert main([*argv, "--check"]) == 1
    err = capsys.readouterr().err
    for var, raw in bad.items():
        assert f"{var}={raw!r} is rejected" in err, err
    assert main([*argv, "--check", "--json"]) == 1
    for var in bad:
        monkeypatch.delenv(var)
    assert main([*argv, "--check"]) == 0


def test_info_check_names_each_option_variable_that_cannot_be_used(monkeypatch, capsys):
    from gangrun import defaults
    from gangrun.cli.entry import main

    bad = {
        "GANGRUN_TIMEOUT": "abc",
        "GANGRUN_OUTPUT": "some",
        "GANGRUN_MAX_RESTARTS": "-1",
        "GANGRUN_RAY_STRATEGY": "FAST",  # an option group's setting
    }
    for var, raw in bad.items():
        monkeypatch.setenv(var, raw)
    monkeypatch.setenv("GANGRUN_GRACE_PERIOD", "3s")  # a good one, for contrast
    argv = ["info", "--processes", "1", "--check"]
    assert main(argv) == 1
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "info --check:" in ln]
    for var in bad:
        assert sum(f"--check: {var}" in ln for ln in lines) == 1, (var, lines)
    assert len(lines) == len(bad), lines
    assert "GANGRUN_MAX_RESTARTS='-1': max_restarts must be >= 0" in "\n".join(lines)
    assert main([*argv, "--json"]) == 1
    assert len([ln for ln in capsys.readouterr().err.splitlines() if "--check:" in ln]) == 4
    with pytest.raises(LaunchError, match="GANGRUN_TIMEOUT='abc'"):  # a call: the first one
        defaults.from_env()
    for var in bad:
        monkeypatch.delenv(var)
    assert main(argv) == 0, capsys.readouterr().err
    assert defaults.env_problems() == []


def test_a_process_setting_takes_a_duration_as_every_option_does(monkeypatch, capsys):
    """One parser for every duration: ``GANGRUN_SLOW_AFTER=2m`` is accepted as
    ``GANGRUN_TIMEOUT=2m`` is (not seconds only)."""
    from gangrun import settings
    from gangrun.cli.entry import main
    from gangrun.lifecycle import watch
    from gangrun.tracking import bounded

    monkeypatch.setenv(contract.SLOW_AFTER, "2m")
    monkeypatch.setenv(contract.SILENT_AFTER, "1h30m")
    monkeypatch.setenv(contract.TRACKING_TIMEOUT, "1.5")
    assert watch.slow_after() == 120.0 and watch.silent_after() == 5400.0
    assert bounded.timeout_s() == 1.5
    assert settings.read(contract.SLOW_AFTER).rejected is None
    assert main(["info", "--processes", "1", "--check"]) == 0, capsys.readouterr().err
    for var, raw in [(contract.SLOW_AFTER, "none"), (contract.TRACKING_TIMEOUT, "0s")]:
        monkeypatch.setenv(var, raw)  # no "none" for a window; a tracking step needs > 0
        assert settings.read(var).rejected == raw, var
    assert watch.slow_after() == 60.0 and bounded.timeout_s() == 60.0


def test_process_settings_defaults_match_their_modules():
    from gangrun.data.cache import default_cache_dir
    from gangrun.lifecycle import watch
    from gangrun.tracking import bounded

    s = contract.SETTINGS
    assert float(s[contract.SLOW_AFTER][0]) == watch.SLOW_AFTER_S == watch.slow_after()
    assert float(s[contract.SILENT_AFTER][0]) == watch.SILENT_AFTER_S == watch.silent_after()
    assert float(s[contract.TRACKING_TIMEOUT][0]) == bounded.DEFAULT_TIMEOUT == bounded.timeout_s()
    assert default_cache_dir().endswith(s[contract.CACHE_DIR][0].lstrip("~"))
    from gangrun.launch.ray import spawner

    deadline = float(s[contract.RAY_CALLER_DEADLINE][0])
    assert deadline == spawner.CALLER_DEADLINE_S == spawner.caller_deadline()


# ---------------------------------------------------------------- fork-server back-off
class _Server:
    def __init__(self, *args) -> None:
        self.args = args

    def alive(self) -> bool:
        return True

    def close(self, wait: float = 2.0) -> None:
        pass


def test_a_failed_fork_server_start_is_retried_after_a_back_off():
    """One failed start does not downgrade every later call for good."""
    now = [1000.0]
    broken = [True]

    def factory(*args):
        if broken[0]:
            raise OSError("boom")
        return _Server(*args)

    reg = Registry(factory, clock=lambda: now[0])  # type: ignore[arg-type]
    assert reg.retry_in() == 0.0
    waits = []
    for _ in range(8):  # each failure doubles the back-off, up to the cap
        with pytest.raises(OSError):
            reg.lease(())
        waits.append(reg.retry_in())
        now[0] += waits[-1]
        assert reg.retry_in() == 0.0  # the back-off is over: the next call tries again
    assert waits[:3] == [RETRY_FIRST_S, 2 * RETRY_FIRST_S, 4 * RETRY_FIRST_S]
    assert waits[-1] == RETRY_MAX_S and max(waits) == RETRY_MAX_S
    assert reg.start_failure == "OSError: boom"
    broken[0] = False
    server = reg.lease((), 3, ForkServerOptions(preload=("json",), start_timeout=7.0))
    assert server.args == (("json",), (), 3, 7.0)  # the call's settings reach the server
    assert (reg.start_failure, reg.failures, reg.retry_in()) == (None, 0, 0.0)
    broken[0] = True  # after a good start, a new failure starts the back-off afresh
    reg.release(server)
    with pytest.raises(OSError):
        reg.lease((), settings=ForkServerOptions(preload=()))
    assert reg.retry_in() == RETRY_FIRST_S
