"""Everything caught before launch raises LaunchError with a useful message (no process starts)."""

from __future__ import annotations

import pytest

import gangrun
from gangrun import LaunchError, distributed
from gangrun.host import accelerators
from gangrun.host.accelerators import Accelerator


def _noop() -> int:
    return 1


@pytest.fixture
def gpus(monkeypatch):
    """Pretend the node has the given GPUs (a mock stands in for hardware we lack)."""

    def set_(*names: str) -> None:
        devs = [Accelerator(i, n, f"GPU-{i}") for i, n in enumerate(names)]
        monkeypatch.setattr(accelerators, "detect", lambda: devs)

    return set_


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"gpus": 2, "processes": 2}, "not both"),
        ({"processes": 0}, "processes must be >= 1"),
        ({"processes": -3}, "processes must be >= 1"),
        ({"processes": 1.5}, "processes must be an integer"),
        ({"processes": True}, "processes must be an integer"),
        ({"gpus": 0}, "gpus must be >= 1"),
        ({"timeout": -5}, "timeout must be a positive number"),
        ({"timeout": "soon"}, "timeout='soon': 'soon' is not a duration: give seconds"),
        ({"timeout": [60]}, "timeout must be a number"),
        ({"output": "rank1"}, "output must be one of"),
        ({"max_restarts": -1}, "max_restarts must be >= 0"),
        ({"restart_backoff": -1}, "restart_backoff must be a number of seconds >= 0"),
        ({"restart_backoff_max": "none"}, "restart_backoff_max cannot be none"),
        ({"grace_period": "5 minutes"}, "grace_period='5 minutes': '5 minutes' is not a duration"),
        ({"gpu_type": ""}, "gpu_type must be a non-empty string"),
        ({"env": {"A=B": "x"}}, "invalid variable name"),
        ({"env": {"X": None}}, "must be a string"),
        ({"bogus": 1}, "unknown @distributed argument"),
    ],
)
def test_bad_decorator_arguments(kwargs, fragment):
    with pytest.raises(LaunchError, match=fragment):
        distributed(**kwargs)(_noop)


def test_timeout_none_disables():
    f = distributed(processes=1, timeout=None)(_noop)
    assert f.settings.timeout is None


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("10m", 600.0),
        ("90", 90.0),
        ("90s", 90.0),
        ("1h30m", 5400.0),
        (" 2h ", 7200.0),
        ("1.5", 1.5),
        ("none", None),
        ("0", None),
        ("1h30", 5400.0),  # a last number without a unit: the unit after the one before it
        ("1m30", 90.0),
        ("1h30m15", 5415.0),
    ],
)
def test_a_duration_as_text_means_the_same_in_every_channel(text, seconds, monkeypatch):
    """``timeout="10m"`` works in Python as ``GANGRUN_TIMEOUT=10m`` and ``--timeout 10m``
    do: one parser (`gangrun.durations`) for every channel."""
    from gangrun import defaults
    from gangrun.cli import entry as cli
    from gangrun.cli.options import options_from_args

    for name in ("GANGRUN_TIMEOUT", "GANGRUN_HANG_TIMEOUT", "GANGRUN_GPU_WAIT"):
        monkeypatch.delenv(name, raising=False)
    decorated = distributed(processes=1, timeout=text, hang_timeout=text)(_noop)
    assert decorated.settings.timeout == seconds and decorated.settings.hang_timeout == seconds
    assert distributed(processes=1)(_noop).options(timeout=text).settings.timeout == seconds
    try:
        gangrun.set_defaults(timeout=text)
        assert distributed(processes=1)(_noop).settings.timeout == seconds
    finally:
        gangrun.reset_defaults()
    monkeypatch.setenv("GANGRUN_TIMEOUT", text)
    assert defaults.resolve({}).timeout == seconds  # the environment
    ns = cli._parsers()[0].parse_args(["run", "--timeout", text])  # the command line
    assert options_from_args(ns)["timeout"] == seconds
    if seconds is not None:  # a group's duration, and the ones that cannot be none
        assert gangrun.RayOptions(placement_timeout=text).validate().placement_timeout == seconds
        fs = gangrun.ForkServerOptions(start_timeout=text).validate()
        assert fs.start_timeout == seconds
        assert distributed(processes=1, grace_period=text)(_noop).settings.grace_period == seconds


def test_the_python_durations_are_the_options_read_as_durations_from_text():
    import dataclasses

    from gangrun.defaults import _kind
    from gangrun.options import DURATIONS, Options

    read_as_durations = {
        f.name for f in dataclasses.fields(Options) if _kind(f.name, str(f.type)) == "duration"
    }
    assert read_as_durations == set(DURATIONS)


def test_a_bad_duration_as_text_says_what_a_duration_is():
    from gangrun.options import DURATIONS, Options

    for name in DURATIONS:
        with pytest.raises(
            LaunchError, match=rf"{name}='ten minutes': .* give seconds \(90\), or 90s, 15m"
        ):
            distributed(**{name: "ten minutes"})(_noop)
    with pytest.raises(LaunchError, match="grace_period cannot be none"):
        Options(grace_period="none").validate()
    with pytest.raises(LaunchError, match="ray.placement_timeout cannot be none"):
        gangrun.RayOptions(placement_timeout="none").validate()
    with pytest.raises(LaunchError, match="forkserver.start_timeout='soon': 'soon' is not a"):
        gangrun.ForkServerOptions(start_timeout="soon").validate()


@pytest.mark.parametrize("name", ["timeout", "hang_timeout", "gpu_wait", "grace_period"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_nan_and_infinities_are_refused_where_seconds_are_meant(name, value, monkeypatch):
    # a NaN compares false to every bound: it passed the checks and ran with no limit at all
    with pytest.raises(LaunchError, match=rf"{name} must be a .*number of seconds .*\(finite"):
        distributed(processes=1, **{name: value})(_noop)
    with pytest.raises(LaunchError, match=rf"{name} must be a .*number of seconds .*\(finite"):
        distributed(processes=1)(_noop).options(**{name: value})
    with pytest.raises(LaunchError, match=r"number of seconds \(finite\)"):
        gangrun.RayOptions(placement_timeout=value).validate()
    with pytest.raises(LaunchError, match=r"number of seconds \(finite\)"):
        gangrun.ForkServerOptions(start_timeout=value).validate()

    def no_start(self):
        raise AssertionError("the gang started")

    monkeypatch.setattr(gangrun.Gang, "_start", no_start)
    for arg in ("start_timeout", "interrupt_grace"):
        with pytest.raises(LaunchError, match=rf"Gang\({arg}=.*number of seconds \(finite\)"):
            gangrun.Gang(processes=1, **{arg: value})


@pytest.mark.parametrize("name", ["timeout", "hang_timeout"])
def test_zero_as_a_number_means_no_limit_as_the_text_does(name, monkeypatch):
    monkeypatch.delenv(f"GANGRUN_{name.upper()}", raising=False)
    for zero in (0, 0.0, "0"):
        assert getattr(distributed(processes=1, **{name: zero})(_noop).settings, name) is None
        f = distributed(processes=1, **{name: 60})(_noop).options(**{name: zero})
        assert getattr(f.settings, name) is None
    with pytest.raises(
        LaunchError, match=rf"{name} must be a positive number of seconds \(finite; None or 0: no"
    ):
        distributed(processes=1, **{name: -1})(_noop)


def test_bare_decorator_and_plain_call():
    f = distributed(_noop)
    assert f() == 1
    assert f.__name__ == "_noop"
    assert isinstance(f, gangrun.DistributedFunction)


def test_options_returns_copy():
    f = distributed(processes=2, timeout=10)(_noop)
    g = f.options(processes=4)
    assert f.settings.processes == 2 and g.settings.processes == 4
    assert g.settings.timeout == 10
    h = f.options(gpus=2)
    assert h.settings.gpus == 2 and h.settings.processes is None
    with pytest.raises(LaunchError, match="unknown option"):
        f.options(gpuz=1)
    with pytest.raises(LaunchError, match="timeout"):
        f.options(timeout=-1)


def test_no_gpu_and_no_processes_suggests_processes(gpus):
    gpus()
    with pytest.raises(LaunchError, match=r"processes=N"):
        distributed()(_noop).submit()


def test_gpus_beyond_node(gpus):
    gpus("NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3")
    with pytest.raises(LaunchError, match=r"gpus=8 but this node has 2 visible GPU"):
        distributed(gpus=8)(_noop).submit()


def test_gpu_type_mismatch(gpus):
    gpus("NVIDIA A100-SXM4-80GB")
    with pytest.raises(LaunchError, match=r"gpu_type='H100' does not match .*A100"):
        distributed(gpus=1, gpu_type="H100")(_noop).submit()


def test_gpu_type_without_gpu(gpus):
    gpus()
    with pytest.raises(LaunchError, match="no GPU is attached"):
        distributed(processes=1, gpu_type="H100")(_noop).submit()


@pytest.mark.parametrize(
    "name, want, ok",
    [
        ("NVIDIA H100 80GB HBM3", "H100", True),
        ("NVIDIA H100 80GB HBM3", "h100", True),
        ("NVIDIA H200", "H200", True),
        ("NVIDIA H200", "H100", False),
        ("NVIDIA A10G", "A10", True),
        ("NVIDIA A100-SXM4-80GB", "A10", False),
        ("NVIDIA A100-SXM4-80GB", "A100", True),
        ("NVIDIA GeForce RTX 4090", "RTX 4090", True),
        ("NVIDIA GeForce RTX 4090", "4080", False),
    ],
)
def test_gpu_type_matching(name, want, ok):
    assert accelerators.matches_type(name, want) is ok


def test_visible_devices_filter():
    devs = [Accelerator(i, "NVIDIA H100", f"GPU-aaa{i}") for i in range(4)]
    assert [d.index for d in accelerators._apply_visible(devs, "2,0")] == [2, 0]
    assert [d.index for d in accelerators._apply_visible(devs, "GPU-aaa3")] == [3]
    assert accelerators._apply_visible(devs, "") == []
    assert len(accelerators._apply_visible(devs, None)) == 4
