"""gangrun's logger: its warnings reach the user (stderr, or the application's handlers);
GANGRUN_LOG_LEVEL adds a handler at that level; a call applies it.

Every logger named here is one gangrun really uses: a module of that name exists."""

from __future__ import annotations

import importlib.util
import logging

import pytest

from conftest import run_python
from gangrun import _log
from gangrun.wire.contract import LOG_LEVEL

CODE = (
    "from gangrun._log import get_logger; log = get_logger('launch'); "
    "log.debug('debug line'); log.warning('warning line')"
)
NO_LEVEL: dict[str, str | None] = {LOG_LEVEL: None}


def _exists(logger: str) -> bool:
    return importlib.util.find_spec(logger) is not None


def test_the_loggers_named_here_are_modules():
    named = ("gangrun.launch", "gangrun.launch.gang", "gangrun.data", "gangrun.output")
    for name in (*named, "gangrun.lifecycle"):
        assert _exists(name), f"{name}: no such module; name a logger gangrun uses"


def test_warnings_reach_stderr_by_default_debug_does_not():
    proc = run_python(CODE, env=NO_LEVEL)
    assert proc.returncode == 0
    assert proc.stderr == "warning line\n"  # Python's last-resort handler, nothing of ours


def test_the_applications_logging_decides_when_it_is_configured():
    code = "import logging; logging.basicConfig(level=logging.ERROR); " + CODE
    proc = run_python(code, env=NO_LEVEL)
    assert proc.returncode == 0 and proc.stderr == ""
    code = "import logging; logging.basicConfig(format='app %(name)s %(message)s'); " + CODE
    proc = run_python(code, env=NO_LEVEL)
    assert proc.stderr == "app gangrun.launch warning line\n"


@pytest.mark.slow  # two real calls (one rank each)
def test_a_warning_inside_a_call_reaches_the_user():
    # a module's own logger (not get_logger), after a call configured the gangrun logger
    code = (
        "import logging, gangrun\n"
        "f = gangrun.distributed(processes=1, timeout=60)(lambda: 1)\n"
        "h = f.submit(); h.result()\n"
        "logging.getLogger('gangrun.output').warning('rank 1: its log file is incomplete')\n"
        "logging.getLogger('gangrun.lifecycle').debug('a debug line')\n"
    )
    proc = run_python(code, env=NO_LEVEL, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "rank 1: its log file is incomplete" in proc.stderr and "debug" not in proc.stderr
    # honoured by the call itself, with no code
    proc = run_python(code, env={LOG_LEVEL: "DEBUG"}, timeout=120)
    assert "gangrun DEBUG gangrun.lifecycle: a debug line" in proc.stderr, proc.stderr


def test_level_from_environment():
    proc = run_python(CODE, env={LOG_LEVEL: "debug"})
    assert "gangrun DEBUG gangrun.launch: debug line" in proc.stderr
    assert "gangrun WARNING gangrun.launch: warning line" in proc.stderr
    proc = run_python(CODE, env={LOG_LEVEL: "error"})
    assert proc.stderr == ""
    proc = run_python(CODE, env={LOG_LEVEL: "loud"})
    assert "is not a log level" in proc.stderr and "warning line" in proc.stderr


def test_children_and_names(monkeypatch):
    monkeypatch.delenv(LOG_LEVEL, raising=False)
    root = _log.configure(force=True)
    assert not any(getattr(h, "_gangrun", False) for h in root.handlers)
    assert not any(isinstance(h, logging.NullHandler) for h in root.handlers)
    monkeypatch.setenv(LOG_LEVEL, "INFO")
    root = _log.configure(force=True)
    assert _log.get_logger("gangrun.launch.gang").name == "gangrun.launch.gang"
    assert _log.get_logger("data").name == "gangrun.data"
    assert _log.get_logger().name == "gangrun"
    assert sum(getattr(h, "_gangrun", False) for h in root.handlers) == 1
    monkeypatch.delenv(LOG_LEVEL)
    _log.configure(force=True)
