"""Shared test fixtures: isolation of what libraries write, and the no-leak guarantee.

Every test that starts rank processes is checked afterwards: no process that carries this
test process as its gangrun caller (``GANGRUN_CALLER_PID``) may survive, descendants included.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"

# One temporary directory per test session (the MLflow store, torch extensions, Ray's files),
# removed when the session's process exits. Processes the session starts (ranks unpickling a
# test's function import this module again) inherit its path and reuse it: they neither make
# a directory of their own nor remove the session's.
_TMP_VAR = "GANGRUN_TEST_SESSION_TMP"


def _remove_session_tmp(path: str, owner: int) -> None:
    if os.getpid() == owner:  # not a forked child exiting
        shutil.rmtree(path, ignore_errors=True)


def _session_tmp() -> str:
    inherited = os.environ.get(_TMP_VAR, "")
    if inherited and os.path.isdir(inherited):
        return inherited
    path = tempfile.mkdtemp(prefix="gangrun-tests-")
    os.environ[_TMP_VAR] = path
    atexit.register(_remove_session_tmp, path, os.getpid())
    return path


_SESSION_TMP = _session_tmp()
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{_SESSION_TMP}/mlflow.db"
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(_SESSION_TMP, "torch_extensions"))
os.environ.setdefault("RAY_TMPDIR", os.path.join(_SESSION_TMP, "ray"))
os.environ["PYTHONPATH"] = str(SRC) + (
    os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""
)


def run_processes(caller_pid: int | None = None) -> list[psutil.Process]:
    """Live processes started by gangrun for ``caller_pid`` (default: this process)."""
    want = str(caller_pid or os.getpid())
    found = []
    for p in psutil.process_iter():
        try:
            if p.pid == os.getpid() or p.status() == psutil.STATUS_ZOMBIE:
                continue
            if p.environ().get("GANGRUN_CALLER_PID") == want:
                found.append(p)
        except (psutil.Error, OSError):
            continue
    return found


def assert_no_survivors(caller_pid: int | None = None, wait: float = 5.0) -> None:
    deadline = time.monotonic() + wait
    left = run_processes(caller_pid)
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = run_processes(caller_pid)
    desc = [f"{p.pid} {' '.join(p.cmdline())[:120]}" for p in left if p.is_running()]
    for p in left:
        try:
            p.kill()
        except psutil.Error:
            pass
    assert not desc, f"processes of the run survived: {desc}"


def pids_alive(pids) -> list[int]:
    alive = []
    for pid in pids:
        try:
            p = psutil.Process(int(pid))
            if p.status() != psutil.STATUS_ZOMBIE:
                alive.append(int(pid))
        except psutil.NoSuchProcess:
            pass
    return alive


@pytest.fixture(autouse=True)
def no_leaked_processes():
    yield
    assert_no_survivors()


@pytest.fixture
def script(tmp_path):
    """Write a caller script to a file and start it as its own Python process."""

    def make(code: str, *args: str, **popen_kw) -> subprocess.Popen:
        path = tmp_path / "caller.py"
        path.write_text(textwrap.dedent(code))
        env = dict(os.environ)
        env.update(popen_kw.pop("env", {}) or {})
        return subprocess.Popen(
            [sys.executable, str(path), *args],
            cwd=str(tmp_path),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            **popen_kw,
        )

    return make


_store_ready = False


@pytest.fixture(autouse=True)
def mlflow_store_created_once(request):
    """Create the session's MLflow sqlite store up front, in this process, before the first
    test that starts processes. MLflow's first-time schema migration is not safe against a
    creator killed midway (a test that SIGKILLs its caller subprocess during the ~1 s of table
    creation leaves ``_alembic_tmp_*`` tables that break every later use of the store), nor
    against two first creators at once (ranks that log with ``mlflow=False`` into a store
    nobody created yet). Process-free unit tests do not pay for it."""
    global _store_ready
    if not _store_ready and "unit" not in request.path.parts:
        from mlflow import MlflowClient

        MlflowClient(os.environ["MLFLOW_TRACKING_URI"]).search_experiments(max_results=1)
        _store_ready = True
    yield
