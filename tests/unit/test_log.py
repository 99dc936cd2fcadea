"""gangrun's logger: a NullHandler unless GANGRUN_LOG_LEVEL asks for output."""

from __future__ import annotations

import logging
import subprocess
import sys

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


def test_quiet_by_default():
    proc = _run({})
    assert proc.returncode == 0 and proc.stderr == ""  # no "No handlers" fallback output


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
    assert any(isinstance(h, logging.NullHandler) for h in root.handlers)
    assert _log.get_logger("gangrun.launch.local").name == "gangrun.launch.local"
    assert _log.get_logger("data").name == "gangrun.data"
    assert _log.get_logger().name == "gangrun"
    assert sum(getattr(h, "_gangrun", False) for h in root.handlers) == 1
