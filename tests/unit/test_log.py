"""gangrun's logger: its warnings reach the user (stderr, or the application's handlers);
GANGRUN_LOG_LEVEL adds a handler at that level; a call applies it (issue 24, item 17)."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from gangrun import _log

CODE = (
    "from gangrun._log import get_logger; log = get_logger('run'); "
    "log.debug('debug line'); log.warning('warning line')"
)


def _run(env_extra):
    import os

    env = {k: v for k, v in os.environ.items() if k != "GANGRUN_LOG_LEVEL"}
    env.update(env_extra)
    return subprocess.run(
        [sys.executable, "-c", CODE], env=env, capture_output=True, text=True, timeout=60
    )


def test_warnings_reach_stderr_by_default_debug_does_not():
    proc = _run({})
    assert proc.returncode == 0
    assert proc.stderr == "warning line\n"  # Python's last-resort handler, nothing of ours


def test_the_applications_logging_decides_when_it_is_configured():
    code = "import logging; logging.basicConfig(level=logging.ERROR); " + CODE
    env = {k: v for k, v in __import__("os").environ.items() if k != "GANGRUN_LOG_LEVEL"}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and proc.stderr == ""
    code = "import logging; logging.basicConfig(format='app %(name)s %(message)s'); " + CODE
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.stderr == "app gangrun.run warning line\n"


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
    env = {k: v for k, v in __import__("os").environ.items() if k != "GANGRUN_LOG_LEVEL"}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "rank 1: its log file is incomplete" in proc.stderr and "debug" not in proc.stderr
    env["GANGRUN_LOG_LEVEL"] = "DEBUG"  # honoured by the call itself, with no code
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert "gangrun DEBUG gangrun.lifecycle: a debug line" in proc.stderr, proc.stderr


def test_level_from_environment():
    proc = _run({"GANGRUN_LOG_LEVEL": "debug"})
    assert "gangrun DEBUG gangrun.run: debug line" in proc.stderr
    assert "gangrun WARNING gangrun.run: warning line" in proc.stderr
    proc = _run({"GANGRUN_LOG_LEVEL": "error"})
    assert proc.stderr == ""
    proc = _run({"GANGRUN_LOG_LEVEL": "loud"})
    assert "is not a log level" in proc.stderr and "warning line" in proc.stderr


def test_children_and_names(monkeypatch):
    monkeypatch.delenv("GANGRUN_LOG_LEVEL", raising=False)
    root = _log.configure(force=True)
    assert not any(getattr(h, "_gangrun", False) for h in root.handlers)
    assert not any(isinstance(h, logging.NullHandler) for h in root.handlers)
    monkeypatch.setenv("GANGRUN_LOG_LEVEL", "INFO")
    root = _log.configure(force=True)
    assert _log.get_logger("gangrun.launch.local").name == "gangrun.launch.local"
    assert _log.get_logger("data").name == "gangrun.data"
    assert _log.get_logger().name == "gangrun"
    assert sum(getattr(h, "_gangrun", False) for h in root.handlers) == 1
    monkeypatch.delenv("GANGRUN_LOG_LEVEL")
    _log.configure(force=True)
