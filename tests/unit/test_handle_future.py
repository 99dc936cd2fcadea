"""`RunHandle` is a `concurrent.futures.Future` completed through Future's public methods only
(no private field of ``concurrent.futures._base`` is read or written, so a Python release
cannot change it): the states, `wait` / `as_completed`, the callbacks, and a ``cancel()`` that
returns at once while the ranks are torn down. The gang is `tests/fakes`'s,
under the real `Supervisor`; tests/system/test_futures.py runs the same on real ranks."""

from __future__ import annotations

import ast
import concurrent.futures as cf
import queue
import threading
import time
from pathlib import Path

import pytest

from fakes import FakeGang, both_return, supervisor
from gangrun import DistributedCancelledError, DistributedError
from gangrun.api import RunHandle
from gangrun.options import Options

SRC = Path(__file__).resolve().parents[2] / "src" / "gangrun"


class SlowTeardownGang(FakeGang):
    """Ranks that run until stopped, and take ``teardown`` seconds to die when they are."""

    teardown = 1.0

    def stop(self, grace: float | None = None) -> None:
        time.sleep(self.teardown)
        super().stop(grace)


def handle(script=lambda g: None, gang=FakeGang) -> RunHandle:
    o = Options(processes=2, mlflow=False, timeout=None, grace_period=0.1).validate()

    def factory(spec, pump, events: queue.Queue) -> FakeGang:
        return gang(spec, events, script, 0)

    sup = supervisor(o, factory)
    sup.start()
    return RunHandle(sup)


def test_cancel_returns_at_once_and_the_end_makes_it_cancelled():
    h = handle(gang=SlowTeardownGang)
    assert h.running() and not h.done() and not h.cancelled()
    t0 = time.monotonic()
    assert h.cancel(reason="stopped by the test") is True
    assert time.monotonic() - t0 < SlowTeardownGang.teardown / 2  # not the teardown
    assert h.running() and not h.done() and not h.cancelled()  # the ranks still go down
    done, pending = cf.wait([h], timeout=10)
    assert done == {h} and not pending
    assert h.cancelled() and h.done() and not h.running()
    err = h.exception(timeout=0)
    assert isinstance(err, DistributedCancelledError) and isinstance(err, cf.CancelledError)
    assert "stopped by the test" in str(err)
    with pytest.raises(cf.CancelledError):  # what a plain Future's caller catches
        h.result()
    assert h.cancel() is False  # already ended


def test_cancel_wait_true_returns_once_the_call_has_ended():
    h = handle(gang=SlowTeardownGang)
    t0 = time.monotonic()
    assert h.cancel(wait=True) is True
    assert time.monotonic() - t0 >= SlowTeardownGang.teardown * 0.9
    assert h.done() and h.cancelled()


def test_results_errors_waiters_and_callbacks():
    ok = handle(both_return)
    bad = handle(lambda g: g.fail(1, "broken"))
    assert cf.wait([ok, bad], timeout=10).not_done == set()
    assert ok.result(timeout=0) == ["a", "b"] and ok.exception() is None
    assert not ok.cancelled() and not ok.running() and not bad.cancelled()
    first_error = cf.wait([ok, bad], timeout=0, return_when=cf.FIRST_EXCEPTION)
    assert bad in first_error.done
    assert isinstance(bad.exception(), DistributedError) and bad.exception().rank == 1
    assert {id(f) for f in cf.as_completed([ok, bad], timeout=1)} == {id(ok), id(bad)}
    late: list[object] = []
    bad.add_done_callback(late.append)  # the call has ended: at once, here
    assert late == [bad]


def test_a_callback_added_while_the_call_runs_fires_once_at_its_end():
    go = threading.Event()

    def script(g: FakeGang) -> None:
        threading.Thread(target=lambda: (go.wait(10), both_return(g)), daemon=True).start()

    h = handle(script)
    fired: list[tuple[object, str]] = []
    h.add_done_callback(lambda f: fired.append((f, threading.current_thread().name)))
    h.add_done_callback(lambda f: 1 / 0)  # logged; the others still run
    h.add_done_callback(lambda f: fired.append((f, "second")))
    assert not fired
    go.set()
    assert h.result(timeout=10) == ["a", "b"]
    deadline = time.monotonic() + 10
    while len(fired) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fired == [(h, f"gangrun-run-{h.run_id}"), (h, "second")]


def test_the_future_is_not_completed_from_outside():
    h = handle(both_return)
    for attempt in (
        lambda: h.set_result([1]),
        lambda: h.set_exception(ValueError()),
        h.set_running_or_notify_cancel,
    ):
        with pytest.raises(RuntimeError, match="completed by its call"):
            attempt()
    assert h.result(timeout=10) == ["a", "b"]


# ------------------------------------------------------------------ no private Future field
def _future_private_names() -> set[str]:
    """What a Future keeps privately: its fields and its private methods."""
    names = set(vars(cf.Future()))
    names |= {n for n in vars(cf.Future) if n.startswith("_") and not n.startswith("__")}
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _is_future_base(node: ast.expr) -> bool:
    while isinstance(node, ast.Subscript):  # Future[list[R]]
        node = node.value
    name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")
    return name == "Future"


def _violations(tree: ast.Module, private: set[str]) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if mod.startswith("concurrent.futures._") or (
                mod == "concurrent.futures" and any(a.name.startswith("_") for a in node.names)
            ):
                found.append(f"line {node.lineno}: from {mod} import a private module")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("concurrent.futures._"):
                    found.append(f"line {node.lineno}: import {a.name}")
        elif isinstance(node, ast.Attribute) and node.attr == "_base":
            found.append(f"line {node.lineno}: ._base")
        elif isinstance(node, ast.ClassDef) and any(_is_future_base(b) for b in node.bases):
            for sub in ast.walk(node):
                if (
                    isinstance(sub, ast.Attribute)
                    and sub.attr in private
                    and isinstance(sub.value, ast.Name)
                    and sub.value.id == "self"
                ):
                    found.append(f"line {sub.lineno}: {node.name} uses Future's self.{sub.attr}")
    return found


def test_the_private_field_check_finds_what_it_looks_for():
    old = """
from concurrent.futures import _base as _futures
import concurrent.futures
class H(concurrent.futures.Future[list]):
    def settle(self):
        with self._condition:
            self._state = _futures.FINISHED
"""
    got = _violations(ast.parse(old), _future_private_names())
    assert len(got) == 3 and "self._condition" in got[1] and "self._state" in got[2], got


def test_no_module_uses_concurrent_futures_private_parts():
    """No module imports ``concurrent.futures._base`` (or another private part of it), and no
    subclass of ``Future`` touches Future's private fields (``_state``, ``_condition``,
    ``_waiters``, ``_done_callbacks``...): their names and meaning are CPython's to change."""
    private = _future_private_names()
    assert {"_state", "_condition", "_waiters", "_done_callbacks"} <= private
    found = []
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        if "futures" not in text and "Future" not in text:
            continue  # nothing of concurrent.futures here (and no parse to pay for)
        for v in _violations(ast.parse(text, str(path)), private):
            found.append(f"{path.relative_to(SRC.parent)} {v}")
    assert not found, "concurrent.futures' private parts used:\n" + "\n".join(found)
