"""Shared test fixtures: isolation of what libraries write, and the no-leak guarantee.

Every test that starts rank processes is checked afterwards: no process that carries this
test process as its gangrun caller (``GANGRUN_CALLER_PID``) may survive, descendants included.
At the end the session fails when it left files behind: gangrun's directories in its temp dir
(``TMPDIR`` is the session's own directory, for every process it starts) or anything new
under ``~/.cache/gangrun`` (`leftovers`).

What a new test can lean on (see also ``tests/fakes.py``, the process-free stand-ins):

- MLflow tracking is off for every test: the session sets ``GANGRUN_MLFLOW=0`` (the option's
  ``GANGRUN_<OPTION>`` default, `gangrun.defaults`), so no call needs ``mlflow=False``. A test
  of tracking turns it back on with ``@pytest.mark.mlflow`` (or ``pytestmark`` for a module):
  the variable is unset for it, and for the processes it starts (kernels, ``gangrun run``).
- `run_python` (a snippet in a fresh interpreter) and `run_bounded` (any command, e.g.
  ``python -m gangrun run``): this session's environment, bounded, nothing left running.
- The unit tier (``tests/unit``) has a time budget: its durations are printed at the end of
  a session, and the session fails when their sum exceeds `UNIT_BUDGET_S`.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

import tiers
from gangrun.defaults import env_var

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"

# One temporary directory per test session (the MLflow store, torch extensions, Ray's files),
# removed when the session's process exits. Processes the session starts (ranks unpickling a
# test's function import this module again) inherit its path and reuse it: they neither make
# a directory of their own nor remove the session's.
# Under pytest-xdist (``-n``) each worker is a session of its own: its own directory, MLflow
# store and leak check, so that workers running side by side see nothing of each other's.
# A worker inherits the directory of the controller that started it, which ``_WORKER_VAR``
# says was made by another process than this worker's (``PYTEST_XDIST_WORKER``), so it
# makes its own; the ranks and commands a worker starts inherit both and reuse the worker's.
_TMP_VAR = "GANGRUN_TEST_SESSION_TMP"
_WORKER_VAR = "GANGRUN_TEST_SESSION_WORKER"  # the xdist worker whose directory it is ("": none)
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")


def _remove_session_tmp(path: str, owner: int) -> None:
    if os.getpid() == owner:  # not a forked child exiting
        shutil.rmtree(path, ignore_errors=True)


def _session_tmp() -> tuple[str, bool]:
    """The session's directory, and whether this process made it (the session itself)."""
    inherited = os.environ.get(_TMP_VAR, "")
    if inherited and os.path.isdir(inherited):
        if os.environ.get(_WORKER_VAR, "") == WORKER:
            return inherited, False
        # an xdist worker: its own, beside (not inside) its controller's
        path = tempfile.mkdtemp(prefix=f"gangrun-tests-{WORKER}-", dir=os.path.dirname(inherited))
    else:
        path = tempfile.mkdtemp(prefix="gangrun-tests-")
    os.environ[_TMP_VAR] = path
    os.environ[_WORKER_VAR] = WORKER
    atexit.register(_remove_session_tmp, path, os.getpid())
    return path, True


_SESSION_TMP, _OWNER = _session_tmp()
if _OWNER:
    # The temp dir of the session and of every process it starts: the run directories, the
    # logs a failed `gangrun run` keeps, GPU lock files... land here, where the leak check
    # (`leftovers`) looks at the end, and go with the directory. `tmp_path` stays where
    # pytest keeps it (its paths are no longer than before).
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
    os.environ["TMPDIR"] = _SESSION_TMP
    tempfile.tempdir = None  # read TMPDIR again (pytest's capture files already read it)
# gangrun.data's file cache: not the user's ~/.cache/gangrun/data
os.environ["GANGRUN_CACHE_DIR"] = os.path.join(_SESSION_TMP, "data-cache")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{_SESSION_TMP}/mlflow.db"
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(_SESSION_TMP, "torch_extensions"))
os.environ.setdefault("RAY_TMPDIR", os.path.join(_SESSION_TMP, "ray"))
os.environ["PYTHONPATH"] = str(SRC) + (
    os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""
)


# --------------------------------------------------------------------- SIGINT, even when ignored
def restore_sigint() -> None:
    """``make test &``, ``nohup``, cron and some CI runners start the session with SIGINT
    ignored; Python then keeps it ignored (no ``KeyboardInterrupt``), and so does every
    process the session starts, so the tests that interrupt a call (``interrupt_main``, a
    SIGINT to a ``gangrun run`` or a kernel) would wait out their timeouts. The session
    restores Python's own handler: the processes it then starts get SIGINT's default again
    (a caught signal is reset by ``exec``), and forked ones the handler."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


# ----------------------------------------------------------------------- MLflow off by default
MLFLOW_VAR = env_var("mlflow")  # GANGRUN_MLFLOW: the default of the option ``mlflow``


def pytest_configure(config: pytest.Config) -> None:
    # Here, not at import: ranks that import this module again keep their caller's setting.
    os.environ[MLFLOW_VAR] = "0"
    restore_sigint()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before any fixture of the test (a module's kernel, too) starts a process."""
    if item.get_closest_marker("mlflow") is not None:
        os.environ.pop(MLFLOW_VAR, None)
    else:
        os.environ[MLFLOW_VAR] = "0"


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
    fakes = sys.modules.get("fakes")
    if fakes is not None:  # supervisors a unit test made: their run directories go
        fakes.release_all()
    assert_no_survivors()


# ------------------------------------------------------------------------ no files left behind
HOME_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "gangrun")


def _files_under(top: str) -> set[str]:
    return {os.path.join(d, n) for d, dirs, files in os.walk(top) for n in dirs + files}


_HOME_CACHE_BEFORE = _files_under(HOME_CACHE) if _OWNER else set()


def leftovers() -> list[str]:
    """What the session left that it should not have: gangrun's directories in its temp dir
    (run directories, kept logs, Ray actors' and gangs' directories; not the GPU lock and
    host-lock directories, which are kept by design, nor what gangrun reaps itself), and
    anything new under ``~/.cache/gangrun``."""
    import gc

    from gangrun.host.system import reap_stale
    from gangrun.launch.ray.actor import reap_node_leftovers

    gc.collect()  # a dropped handle's run directory goes with it
    # what gangrun's next call would remove is not left behind: the run directories of
    # callers that died (tests SIGKILL callers on purpose) and of Ray actors that are gone
    reap_stale(_SESSION_TMP, force=True)
    reap_node_leftovers(_SESSION_TMP)
    # a handle still referenced in this process (an error kept by a test, a cache) keeps its
    # call's logs, and its finalizer removes them when it goes, at the latest at exit
    held = _held_run_dirs()
    left = [
        os.path.join(_SESSION_TMP, name) + _whose(os.path.join(_SESSION_TMP, name))
        for name in sorted(os.listdir(_SESSION_TMP))
        if name.startswith("gangrun-")
        and not name.startswith(("gangrun-gpus-", "gangrun-locks-"))
        and os.path.join(_SESSION_TMP, name) not in held
    ]
    return left + sorted(_files_under(HOME_CACHE) - _HOME_CACHE_BEFORE)


def _held_run_dirs() -> set[str]:
    """The run directories of the calls whose handle this process still holds: their
    `weakref.finalize` removes each when the handle goes, at the latest at exit."""
    import gc

    from gangrun.api import RunHandle

    out = set()
    for obj in gc.get_objects():
        if isinstance(obj, RunHandle) and obj._finalizer.alive:
            out.add(os.path.realpath(obj._run.run_dir))
            out.add(obj._run.run_dir)
    return out


def _whose(path: str) -> str:
    """A run directory's call, to find the test that left it: `` (fn, state, caller)``."""
    import json

    from gangrun.host.system import process_identity

    try:
        with open(os.path.join(path, "call.json")) as f:
            rec = json.load(f)
    except (OSError, ValueError):  # no record (not a watched call): what else says whose
        return _whose_unrecorded(path)
    pid = int(rec.get("caller_pid") or 0)
    alive = "alive" if process_identity(pid) == rec.get("caller") else "gone"
    return f" (call of {rec.get('function')}, {rec.get('state')}, caller {pid} {alive})"


def _whose_unrecorded(path: str) -> str:
    """A directory without a call record: its files, its context's caller, and whether a
    supervisor of this process still holds it (and of which function)."""
    import gc
    import json

    try:
        files = sorted(os.listdir(path))[:8]
    except OSError:
        return ""
    caller = ""
    try:
        with open(os.path.join(path, "context.json")) as f:
            caller = str(json.load(f).get("caller", ""))
    except (OSError, ValueError, AttributeError):
        pass
    from gangrun.lifecycle.supervisor import Supervisor

    holders = [
        o.fn_name
        for o in gc.get_objects()
        if isinstance(o, Supervisor) and o.run_dir == path  # noqa: SIM114
    ]
    if not caller and not holders and os.path.basename(path).startswith("gangrun-logs-"):
        return ""  # kept logs: the name says what it is
    return f" (files {files}, caller {caller or '?'}, held by supervisors of {holders})"


_left: list[str] = []


def run_bounded(
    cmd: list[str],
    *,
    env: dict[str, str | None] | None = None,
    timeout: float = 60.0,
    cwd: str | os.PathLike[str] | None = None,
    check: bool = False,
    merge_stderr: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` to its end with this session's environment (plus ``env``; a ``None`` value
    removes that variable), at most ``timeout`` seconds, and assert that nothing it started
    through gangrun survives it. Returns the finished process (``returncode``, ``stdout``,
    ``stderr`` as text; with ``merge_stderr`` both in ``stdout``); with ``check`` a non-zero
    exit fails the test with its output."""
    full = dict(os.environ)
    for k, v in (env or {}).items():
        if v is None:
            full.pop(k, None)
        else:
            full[k] = v
    err_to = subprocess.STDOUT if merge_stderr else subprocess.PIPE
    proc = subprocess.Popen(
        cmd, env=full, cwd=cwd, stdout=subprocess.PIPE, stderr=err_to, text=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        assert_no_survivors(proc.pid, wait=0.0)
        raise AssertionError(
            f"{cmd[:3]} did not end within {timeout} s\n"
            f"--- stdout\n{out[-3000:]}\n--- stderr\n{(err or '')[-3000:]}"
        ) from None
    assert_no_survivors(proc.pid)
    if check:
        assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-3000:]}\n{(err or '')[-3000:]}"
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err or "")


def run_python(code: str, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    """`run_bounded` of ``python -c code args...`` (``code`` dedented): a snippet in a fresh
    interpreter."""
    return run_bounded([sys.executable, "-c", textwrap.dedent(code), *args], **kw)


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


# --------------------------------------------------------------------- the unit tier's budget
# Seconds the whole of tests/unit may take (setup + call + teardown of every test, summed).
# Measured 2026-12-01 on a shared 2-core machine under load: 27.5 s and 44.6 s (526 tests,
# 35-54 s wall); the budget leaves well over 2x of the slower figure. Every session that runs unit tests prints the figure.
UNIT_BUDGET_S = 120.0
_unit_seconds: dict[str, float] = {}


def _is_unit(nodeid: str) -> bool:
    return "unit" in Path(nodeid.split("::", 1)[0]).parts


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Every test's report: under xdist the controller gets its workers' reports here too,
    so the figures below are the whole session's."""
    if _is_unit(report.nodeid):
        _unit_seconds[report.nodeid] = _unit_seconds.get(report.nodeid, 0.0) + report.duration
    tier = _tier_of(report.nodeid)
    _tier_seconds[tier] = _tier_seconds.get(tier, 0.0) + report.duration
    if report.when == "call":
        _tier_tests[tier] = _tier_tests.get(tier, 0) + 1


# ------------------------------------------------------------------------------- the tiers
# What each module needs and the smoke tests: tests/tiers.py. Here they become markers, and
# a module that ``-m`` rules out is not imported. The session ends with the time per tier.
_tier_seconds: dict[str, float] = {}
_tier_tests: dict[str, int] = {}


def _module_of(path: str | os.PathLike[str]) -> str | None:
    """A test module's path relative to tests/ (``system/test_core.py``)."""
    try:
        return Path(path).resolve().relative_to(tiers.TESTS).as_posix()
    except ValueError:
        return None


def _tier_of(nodeid: str) -> str:
    """What a test needs ("kernel+browser"), or "unit" / "fast", from its node id alone (an
    xdist controller collects nothing itself: it has its workers' reports)."""
    path, _, test = nodeid.partition("::")
    module = _module_of(ROOT / path)
    needs = tiers.needs(module, test) if module else set()
    if needs:
        return "+".join(n for n in tiers.FAST_LEAVES_OUT if n in needs)
    return "unit" if _is_unit(nodeid) else "fast"


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    expr = config.getoption("markexpr", "")
    if not expr or collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    module = _module_of(collection_path)
    if module is None or tiers.may_select(expr, module):
        return None
    return True  # nothing in it can be selected: not even imported


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    found: set[str] = set()
    modules: set[str] = set()
    for item in items:
        module = _module_of(item.path)
        if module is None:
            continue
        test = item.nodeid.split("::", 1)[1] if "::" in item.nodeid else item.name
        needs = tiers.needs(module, test)
        for need in sorted(needs):
            item.add_marker(need)
        if tiers.is_smoke(module, test):
            item.add_marker("smoke")
            found.add(f"{module}::{test.split('[', 1)[0]}")
        modules.add(module)
    stale = [s for s in tiers.SMOKE if tiers.module_of(s) in modules and s not in found]
    if stale and not any("::" in a for a in config.args):  # whole modules collected
        raise pytest.UsageError(
            f"tests/tiers.py SMOKE names tests that its modules do not have: {stale}; "
            "rename them there (or take them out)"
        )


def _unit_total() -> float:
    return sum(_unit_seconds.values())


def _unit_budget(config: pytest.Config) -> tuple[float, str]:
    """The unit tier's budget for this session, and how it was reached. Under ``-n N`` each
    worker's tests share the cores with the other workers' (on 2 cores, `make test`'s two
    workers: a unit test beside a gang of ranks), so their durations, which the budget sums,
    stretch by up to N: the budget is N times ``--unit-budget``."""
    budget = float(config.getoption("--unit-budget"))
    workers = int(getattr(config.option, "numprocesses", 0) or 0)
    if workers > 1 and getattr(config.option, "dist", "no") != "no":
        return budget * workers, f" ({budget:g} s x {workers} workers sharing the cores)"
    return budget, ""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--unit-budget",
        type=float,
        default=UNIT_BUDGET_S,
        help="seconds the tests under tests/unit may take in all (their durations summed); "
        f"the session fails past it (default {UNIT_BUDGET_S:g})",
    )


# ------------------------------------------------------------------- pytest-xdist (make test)
@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``-n N --dist loadgroup``: the groups are tests/tiers.py's `tiers.xdist_scope` (every
    Ray test in one, each module outside tests/unit in one), decided from the node ids. Not
    xdist's own ``xdist_group`` marks: its renaming of a marked test's node id is lost on
    pytest 9 (``Node.nodeid`` is no longer ``_nodeid``), so they would group nothing."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class TierGroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return tiers.xdist_scope(_module_of(ROOT / path) or path, nodeid)

    return TierGroupScheduling(config, log)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    """An xdist worker ended (on the controller): what it left behind is the session's."""
    left = getattr(node, "workeroutput", {}).get("gangrun_left", [])
    _left.extend(p for p in left if p not in _left)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if _OWNER:
        _left[:] = sorted({*_left, *leftovers()})
    if workeroutput is not None:  # an xdist worker: its controller reports and decides
        workeroutput["gangrun_left"] = list(_left)
        return
    budget, _ = _unit_budget(session.config)
    if _unit_total() > budget and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if _left and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:  # type: ignore[no-untyped-def]
    if _left:
        terminalreporter.write_sep("-", "files left behind", red=True)
        for path in _left[:20]:
            terminalreporter.write_line(f"  {path}")
        terminalreporter.write_line(
            f"FAILED: the session left {len(_left)} file(s) or directories of gangrun's (in "
            "its temp dir, or under ~/.cache/gangrun): a run that keeps its logs needs "
            "--log-dir (or TMPDIR) under tmp_path, a dataset cache_dir= under tmp_path.",
            red=True,
        )
    if _tier_seconds:
        parts = [
            f"{tier} {secs:.1f} s ({_tier_tests.get(tier, 0)} tests)"
            for tier, secs in sorted(_tier_seconds.items(), key=lambda kv: -kv[1])
        ]
        terminalreporter.write_sep("-", "time by tier (tests/tiers.py): " + ", ".join(parts))
    if not _unit_seconds:
        return
    budget, how = _unit_budget(config)
    total = _unit_total()
    tr = terminalreporter
    tr.write_sep("-", f"unit tier: {total:.1f} s of its {budget:g} s budget{how}")
    for nodeid, secs in sorted(_unit_seconds.items(), key=lambda kv: -kv[1])[:8]:
        tr.write_line(f"{secs:7.2f} s  {nodeid}")
    if total > budget:
        tr.write_line(
            f"FAILED: the unit tier took {total:.1f} s, over its budget of {budget:g} s "
            "(tests/conftest.py UNIT_BUDGET_S): make the slow tests above faster, or move a "
            "test that needs processes to tests/system.",
            red=True,
        )
