"""The test session's temporary directory is removed at exit, and processes the session
starts (ranks importing ``conftest`` again to unpickle a test's function) make none."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from conftest import run_bounded, run_python

TESTS = Path(__file__).resolve().parents[1]
IMPORT_CONFTEST = (
    f"import sys; sys.path.insert(0, {str(TESTS)!r}); import conftest; print(conftest._SESSION_TMP)"
)


def _import_conftest(tmp: Path, **extra: str) -> str:
    env: dict[str, str | None] = {"GANGRUN_TEST_SESSION_TMP": None, "TMPDIR": str(tmp), **extra}
    return run_python(IMPORT_CONFTEST, env=env, timeout=120, check=True).stdout.strip()


def test_session_tmp_is_removed_when_the_session_exits(tmp_path):
    made = _import_conftest(tmp_path)
    assert Path(made).parent == tmp_path  # it was made there...
    assert not list(tmp_path.glob("gangrun-tests-*"))  # ...and removed at exit


def test_a_process_of_the_session_reuses_its_tmp(tmp_path):
    session = tmp_path / "gangrun-tests-session"
    session.mkdir()
    used = _import_conftest(tmp_path, GANGRUN_TEST_SESSION_TMP=str(session))
    assert used == str(session)
    assert [p.name for p in tmp_path.iterdir()] == [session.name]  # none of its own
    assert session.is_dir()  # and the session's is left to the session


def test_the_unit_tier_fails_past_its_time_budget(tmp_path):
    """The budget CI enforces (conftest ``UNIT_BUDGET_S``): an inner session of a copy of
    this conftest, whose one unit test passes but takes longer than the budget, fails."""
    unit = tmp_path / "tests" / "unit"
    unit.mkdir(parents=True)
    (tmp_path / "tests" / "conftest.py").write_text((TESTS / "conftest.py").read_text())
    (tmp_path / "tests" / "tiers.py").write_text((TESTS / "tiers.py").read_text())
    (unit / "test_slow.py").write_text("import time\n\ndef test_slow():\n    time.sleep(0.3)\n")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--rootdir={tmp_path}"]
    over = run_bounded([*cmd, "--unit-budget=0.1", str(unit)], cwd=tmp_path, timeout=120)
    assert over.returncode == 1 and "1 passed" in over.stdout, over.stdout + over.stderr
    assert re.search(r"unit tier: \d+\.\d s of its 0\.1 s budget", over.stdout), over.stdout
    assert "over its budget of 0.1 s" in over.stdout


LEAKS = """
import os, tempfile

def test_leaves_files():
    tempfile.mkdtemp(prefix="gangrun-logs-abc-")  # as a failed `gangrun run` keeps its logs
    os.makedirs(os.path.join(tempfile.gettempdir(), "gangrun-gpus-0"))  # kept by design
    cache = os.path.expanduser("~/.cache/gangrun/data")
    os.makedirs(cache)
    open(os.path.join(cache, "entry"), "w").close()
"""


def test_a_session_that_leaves_files_fails_naming_them(tmp_path):
    """Issue 31 item 19: the leak check also covers directories and files, in the session's
    temp dir (every process it starts uses it) and under ~/.cache/gangrun."""
    tests = tmp_path / "tests"
    (tests / "unit").mkdir(parents=True)  # (a unit test: no MLflow store made for it)
    (tests / "conftest.py").write_text((TESTS / "conftest.py").read_text())
    (tests / "tiers.py").write_text((TESTS / "tiers.py").read_text())
    (tests / "unit" / "test_leaks.py").write_text(LEAKS)
    home = tmp_path / "home"
    home.mkdir()
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--rootdir={tmp_path}"]
    env: dict[str, str | None] = {
        "GANGRUN_TEST_SESSION_TMP": None,  # a session of its own, as `make test` starts
        "TMPDIR": str(tmp_path),
        "HOME": str(home),
        "PYTEST_DEBUG_TEMPROOT": str(tmp_path),
    }
    inner = run_bounded([*cmd, str(tests)], cwd=tmp_path, env=env, timeout=120)
    out = inner.stdout
    assert inner.returncode == 1 and "1 passed" in out, out + inner.stderr
    assert "files left behind" in out and "left 3 file(s)" in out, out
    assert re.search(r"gangrun-tests-\w+/gangrun-logs-abc-\w+\n", out), out
    assert f"{home}/.cache/gangrun/data/entry" in out, out
    assert f"{home}/.cache/gangrun/data\n" in out, out
    assert "gangrun-gpus-0" not in out, out


KEEPS_AN_ERROR = """
import gangrun

KEPT = []


def boom():
    raise ValueError("kept")


def test_keeps_a_failed_calls_error():
    try:
        gangrun.distributed(processes=1, timeout=120, mlflow=False)(boom).distributed()
    except gangrun.DistributedError as exc:
        KEPT.append(exc)  # its logs live as long as it does
    assert KEPT and KEPT[0].logs(0) is not None
"""


def test_a_run_directory_held_by_a_live_handle_is_not_a_leftover(tmp_path):
    """A handle (or error) a test keeps holds its call's logs; its finalizer removes them
    when it goes, at the latest at exit: the session-end check does not count them."""
    tests = tmp_path / "tests"
    (tests / "unit").mkdir(parents=True)
    (tests / "conftest.py").write_text((TESTS / "conftest.py").read_text())
    (tests / "tiers.py").write_text((TESTS / "tiers.py").read_text())
    (tests / "unit" / "test_kept.py").write_text(KEEPS_AN_ERROR)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--rootdir={tmp_path}"]
    env: dict[str, str | None] = {
        "GANGRUN_TEST_SESSION_TMP": None,
        "TMPDIR": str(tmp_path),
        "PYTEST_DEBUG_TEMPROOT": str(tmp_path),
    }
    inner = run_bounded([*cmd, str(tests)], cwd=tmp_path, env=env, timeout=180)
    out = inner.stdout
    assert inner.returncode == 0 and "1 passed" in out, out + inner.stderr
    assert "files left behind" not in out, out
