"""The test session's temporary directory is removed at exit, and processes the session
starts (ranks importing ``conftest`` again to unpickle a test's function) make none."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from conftest import run_bounded, run_python

TESTS = Path(__file__).resolve().parents[1]
IMPORT_CONFTEST = (
    f"import sys; sys.path.insert(0, {str(TESTS)!r}); import conftest; print(conftest._SESSION_TMP)"
)


# A session of its own, as `make test` starts: not this one's (nor, when this session is an
# xdist worker, one of its workers: the inner controller would take itself for one).
OWN_SESSION: dict[str, str | None] = {
    "GANGRUN_TEST_SESSION_TMP": None,
    "GANGRUN_TEST_SESSION_WORKER": None,
    "PYTEST_XDIST_WORKER": None,
}
XDIST = ["-n", "2", "--dist", "loadgroup"]


def _import_conftest(tmp: Path, **extra: str) -> str:
    env: dict[str, str | None] = {**OWN_SESSION, "TMPDIR": str(tmp), **extra}
    return run_python(IMPORT_CONFTEST, env=env, timeout=120, check=True).stdout.strip()


def test_session_tmp_is_removed_when_the_session_exits(tmp_path):
    made = _import_conftest(tmp_path)
    assert Path(made).parent == tmp_path  # it was made there...
    assert not list(tmp_path.glob("gangrun-tests-*"))  # ...and removed at exit


def test_a_process_of_the_session_reuses_its_tmp(tmp_path):
    session = tmp_path / "gangrun-tests-session"
    session.mkdir()
    used = _import_conftest(
        tmp_path, GANGRUN_TEST_SESSION_TMP=str(session), GANGRUN_TEST_SESSION_WORKER=""
    )
    assert used == str(session)
    assert [p.name for p in tmp_path.iterdir()] == [session.name]  # none of its own
    assert session.is_dir()  # and the session's is left to the session


def test_an_xdist_worker_makes_its_own_tmp_and_its_processes_reuse_it(tmp_path):
    """Under ``-n``, a worker inherits its controller's directory but is a session of its own
    (its runs, MLflow store and leak check apart from the other workers'); what the worker
    starts reuses the worker's."""
    controller = tmp_path / "gangrun-tests-controller"
    controller.mkdir()
    worker = {"GANGRUN_TEST_SESSION_TMP": str(controller), "GANGRUN_TEST_SESSION_WORKER": ""}
    made = _import_conftest(tmp_path, PYTEST_XDIST_WORKER="gw1", **worker)
    assert made != str(controller) and Path(made).name.startswith("gangrun-tests-gw1-")
    assert Path(made).parent == tmp_path  # beside the controller's, not inside it
    assert not Path(made).exists()  # the worker's own: removed when it exits
    mine = tmp_path / "gangrun-tests-gw1-x"
    mine.mkdir()
    of_worker = {"GANGRUN_TEST_SESSION_TMP": str(mine), "GANGRUN_TEST_SESSION_WORKER": "gw1"}
    assert _import_conftest(tmp_path, PYTEST_XDIST_WORKER="gw1", **of_worker) == str(mine)
    assert mine.is_dir()


@pytest.mark.parametrize("parallel", [[], XDIST], ids=["serial", "xdist"])
def test_the_unit_tier_fails_past_its_time_budget(tmp_path, parallel):
    """The budget CI enforces (conftest ``UNIT_BUDGET_S``): an inner session of a copy of
    this conftest, whose one unit test passes but takes longer than the budget, fails; under
    xdist too (the controller sums its workers' reports)."""
    unit = tmp_path / "tests" / "unit"
    unit.mkdir(parents=True)
    (tmp_path / "tests" / "conftest.py").write_text((TESTS / "conftest.py").read_text())
    (tmp_path / "tests" / "tiers.py").write_text((TESTS / "tiers.py").read_text())
    (unit / "test_slow.py").write_text("import time\n\ndef test_slow():\n    time.sleep(0.5)\n")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--rootdir={tmp_path}"]
    (unit / "test_quick.py").write_text("def test_quick():\n    pass\n")
    argv = [*cmd, *parallel, "--unit-budget=0.1", str(unit)]
    over = run_bounded(argv, cwd=tmp_path, env=OWN_SESSION, timeout=120)
    assert over.returncode == 1 and "2 passed" in over.stdout, over.stdout + over.stderr
    # under -n 2 twice the budget: each worker's tests share the cores with the other's
    budget = "0.2 s budget (0.1 s x 2 workers sharing the cores)" if parallel else "0.1 s budget"
    assert re.search(rf"unit tier: \d+\.\d s of its {re.escape(budget)}", over.stdout), over.stdout
    assert f"over its budget of {budget.split(' budget')[0]}" in over.stdout


def test_the_time_by_tier_counts_each_test_in_its_tier_under_xdist(tmp_path):
    """The controller of ``-n`` collects nothing itself: the time per tier still puts each
    worker's test in the tier tests/tiers.py gives it; and the tests are scheduled in the
    groups of `tiers.xdist_scope`."""
    tests = tmp_path / "tests"
    (tests / "unit").mkdir(parents=True)
    (tests / "conftest.py").write_text((TESTS / "conftest.py").read_text())
    (tests / "tiers.py").write_text((TESTS / "tiers.py").read_text())
    (tests / "unit" / "test_quick.py").write_text("def test_quick():\n    pass\n")
    # a test that tests/tiers.py says needs packaging
    test = "test_make_demo_installs_the_demo_set_and_make_test_the_dev_set"
    (tests / "unit" / "test_demo_install.py").write_text(f"def {test}():\n    pass\n")
    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", f"--rootdir={tmp_path}"]
    env = {**OWN_SESSION, "TMPDIR": str(tmp_path), "PYTEST_DEBUG_TEMPROOT": str(tmp_path)}
    inner = run_bounded([*cmd, *XDIST, str(tests)], cwd=tmp_path, env=env, timeout=120)
    out = inner.stdout
    assert inner.returncode == 0 and "2 passed" in out, out + inner.stderr
    assert "scheduling tests via TierGroupScheduling" in out, out
    tiers_line = next(ln for ln in out.splitlines() if "time by tier" in ln)
    assert re.search(r"packaging \d+\.\d s \(1 tests\)", tiers_line), tiers_line
    assert re.search(r"unit \d+\.\d s \(1 tests\)", tiers_line), tiers_line
    assert "fast" not in tiers_line, tiers_line


LEAKS = """
import os, tempfile

def test_leaves_files():
    tempfile.mkdtemp(prefix="gangrun-logs-abc-")  # as a failed `gangrun run` keeps its logs
    os.makedirs(os.path.join(tempfile.gettempdir(), "gangrun-gpus-0"))  # kept by design
    cache = os.path.expanduser("~/.cache/gangrun/data")
    os.makedirs(cache)
    open(os.path.join(cache, "entry"), "w").close()
"""


@pytest.mark.parametrize("parallel", [[], XDIST], ids=["serial", "xdist"])
def test_a_session_that_leaves_files_fails_naming_them(tmp_path, parallel):
    """The leak check also covers directories and files, in the session's temp dir (every
    process it starts uses it) and under ~/.cache/gangrun; under xdist, in each worker's,
    reported (once) by the controller."""
    tests = tmp_path / "tests"
    (tests / "unit").mkdir(parents=True)  # (a unit test: no MLflow store made for it)
    (tests / "conftest.py").write_text((TESTS / "conftest.py").read_text())
    (tests / "tiers.py").write_text((TESTS / "tiers.py").read_text())
    (tests / "unit" / "test_leaks.py").write_text(LEAKS)
    (tests / "unit" / "test_quick.py").write_text("def test_quick():\n    pass\n")
    home = tmp_path / "home"
    home.mkdir()
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--rootdir={tmp_path}"]
    env: dict[str, str | None] = {
        **OWN_SESSION,
        "TMPDIR": str(tmp_path),
        "HOME": str(home),
        "PYTEST_DEBUG_TEMPROOT": str(tmp_path),
    }
    inner = run_bounded([*cmd, *parallel, str(tests)], cwd=tmp_path, env=env, timeout=120)
    out = inner.stdout
    assert inner.returncode == 1 and "2 passed" in out, out + inner.stderr
    assert "files left behind" in out and "left 3 file(s)" in out, out
    worker = r"gw\d-" if parallel else ""
    assert re.search(rf"gangrun-tests-{worker}\w+/gangrun-logs-abc-\w+\n", out), out
    assert "time by tier (tests/tiers.py): unit " in out and "(2 tests)" in out, out
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
        **OWN_SESSION,
        "TMPDIR": str(tmp_path),
        "PYTEST_DEBUG_TEMPROOT": str(tmp_path),
    }
    inner = run_bounded([*cmd, str(tests)], cwd=tmp_path, env=env, timeout=180)
    out = inner.stdout
    assert inner.returncode == 0 and "1 passed" in out, out + inner.stderr
    assert "files left behind" not in out, out
