"""The ``gangrun`` command: scripts and modules on every rank, exit codes, output."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import assert_no_survivors, run_python

SCRIPT = """
import os, sys
rank = int(os.environ["RANK"])
print(f"hello {rank}/{os.environ['WORLD_SIZE']} name={__name__} argv={sys.argv[1:]}")
mode = sys.argv[1] if len(sys.argv) > 1 else ""
if rank == 1:
    if mode == "exit":
        sys.exit(3)
    if mode == "raise":
        raise ValueError("bad batch on rank 1")
    if mode == "kill":
        os.kill(os.getpid(), 9)
if mode == "sleep":
    import time
    print("sleeping", flush=True)
    time.sleep(60)
"""


def gangrun(tmp_path, *args, timeout=60, **kw):
    # the run directories, and the logs a failed run keeps, under the test's own tmp_path
    kw["env"] = dict(kw.get("env") or os.environ, TMPDIR=str(tmp_path))
    return subprocess.Popen(
        [sys.executable, "-m", "gangrun", *args],
        cwd=str(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def finish(proc, timeout=60):
    out, err = proc.communicate(timeout=timeout)
    assert_no_survivors(proc.pid)
    return proc.returncode, out, err


@pytest.fixture
def train(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(SCRIPT))
    return path


def test_run_script_success(tmp_path, train):
    code, out, err = finish(
        gangrun(tmp_path, "run", "--processes", "2", "--no-mlflow", "train.py", "ok", "--lr", "1")
    )
    assert code == 0, err
    assert "[rank 0] hello 0/2 name=__main__ argv=['ok', '--lr', '1']" in out
    assert "[rank 1] hello 1/2 name=__main__ argv=['ok', '--lr', '1']" in out


def test_output_rank0(tmp_path, train):
    code, out, err = finish(
        gangrun(tmp_path, "run", "--processes", "2", "--no-mlflow", "--output", "rank0", "train.py")
    )
    assert code == 0, err
    assert "[rank 0] hello 0/2" in out
    assert "[rank 1]" not in out


@pytest.mark.parametrize(
    ("mode", "expected", "text"),
    [
        ("exit", 3, "Rank 1 (pid"),
        ("raise", 1, "ValueError: bad batch on rank 1"),
        ("kill", 128 + signal.SIGKILL, "SIGKILL"),
    ],
)
def test_failure_exit_codes(tmp_path, train, mode, expected, text):
    code, out, err = finish(
        gangrun(tmp_path, "run", "--processes", "2", "--no-mlflow", "train.py", mode)
    )
    assert code == expected, err
    assert text in err
    if mode == "raise":
        assert "Traceback" in err and 'train.py", line' in err


def test_timeout_exit_code(tmp_path, train):
    t0 = time.monotonic()
    code, out, err = finish(
        gangrun(
            tmp_path,
            "run",
            "--processes",
            "2",
            "--no-mlflow",
            "--timeout",
            "2",
            "train.py",
            "sleep",
        )
    )
    assert code == 124, err
    assert "timeout" in err
    assert time.monotonic() - t0 < 30


def test_interrupt_exit_code(tmp_path, train):
    proc = gangrun(tmp_path, "run", "--processes", "2", "--no-mlflow", "train.py", "sleep")
    deadline = time.monotonic() + 30
    seen = ""
    assert proc.stdout is not None
    while seen.count("sleeping") < 2 and time.monotonic() < deadline:
        seen += proc.stdout.readline()
    proc.send_signal(signal.SIGINT)
    code, out, err = finish(proc)
    assert code == 130, err


IGNORING_SIGINT = """
import signal, subprocess, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)  # as `make test &`, nohup or cron start a job
sys.exit(subprocess.call([sys.executable, "-m", "pytest", *sys.argv[1:]]))
"""


def test_interrupt_tests_pass_in_a_session_started_with_sigint_ignored():
    """Under an inherited ignored SIGINT (Python keeps an inherited SIG_IGN) the interrupt
    tests would fail after their timeouts; the conftest restores the handler."""
    root = Path(__file__).resolve().parents[2]
    inner = run_python(
        IGNORING_SIGINT,
        "-q",
        "-p",
        "no:cacheprovider",
        "--timeout=50",
        "tests/system/test_core.py::test_keyboard_interrupt_in_caller",
        "tests/system/test_cli.py::test_interrupt_exit_code",
        cwd=root,
        timeout=200,
    )
    assert inner.returncode == 0 and "2 passed" in inner.stdout, inner.stdout[-3000:]


def test_run_module(tmp_path):
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(textwrap.dedent(SCRIPT))
    code, out, err = finish(
        gangrun(tmp_path, "run", "--processes", "2", "--no-mlflow", "-m", "mypkg.train", "a", "-x")
    )
    assert code == 0, err
    assert "[rank 0] hello 0/2 name=__main__ argv=['a', '-x']" in out
    assert "[rank 1] hello 1/2" in out


def test_launch_error_exit_code(tmp_path):
    code, out, err = finish(gangrun(tmp_path, "run", "--processes", "2", "missing.py"))
    assert code == 2
    assert "missing.py" in err


def test_info(tmp_path):
    code, out, err = finish(gangrun(tmp_path, "info", "--processes", "3"))
    assert code == 0, err
    assert "accelerators" in out
    assert "RANK=0" in out and "WORLD_SIZE=3" in out and "MASTER_ADDR=127.0.0.1" in out
    assert os.environ.get("RANK") is None  # info starts nothing
    # every setting with its source: the option groups' fields and the process settings
    rows = {ln.split()[0]: ln.split()[-1] for ln in out.splitlines() if ln.startswith("  ")}
    assert rows["processes"] == "argument"
    assert rows["ray.strategy"] == rows["forkserver.preload"] == "built-in"
    assert "GANGRUN_SLOW_AFTER" in rows and "GANGRUN_LOG_LEVEL" in rows


def test_script_travels_with_its_source(tmp_path, monkeypatch):
    """On another node (backend="ray") the script's path may not exist: its text is shipped."""
    import pickle

    from gangrun.cli.entry import ScriptTarget

    src = tmp_path / "gone.py"
    src.write_text("import sys\nRESULT = sys.argv[1:]\nassert __name__ == '__main__'\n")
    target = pickle.loads(pickle.dumps(ScriptTarget(str(src), ["a", 1])))
    src.unlink()
    run_dir = tmp_path / "rundir"
    run_dir.mkdir()
    monkeypatch.setenv("GANGRUN_RUN_DIR", str(run_dir))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    target()
    assert sys.argv == [str(run_dir / "gone.py"), "a", "1"]


@pytest.mark.slow
def test_run_with_duration_timeout_and_options_from_env(tmp_path, train):
    env = dict(os.environ, GANGRUN_MLFLOW="0", GANGRUN_OUTPUT="rank0")
    code, out, err = finish(
        gangrun(tmp_path, "run", "--processes", "2", "--timeout", "1h", "train.py", env=env)
    )
    assert code == 0, err
    assert "[rank 0] hello 0/2" in out and "[rank 1]" not in out  # GANGRUN_OUTPUT=rank0
    code, out, err = finish(
        gangrun(tmp_path, "run", "--processes", "2", "--timeout", "soon", "train.py", env=env)
    )
    assert code == 2
    assert "usage: gangrun run" in err and "argument --timeout: 'soon' is not a duration" in err
