"""`RunHandle` is a `concurrent.futures.Future` of real 2-rank calls: `wait`, `as_completed`,
`exception()`, `add_done_callback()`, `running()`, `cancelled()`, `cancel(reason=)`; and the
future half keeps no handle (nor its run directory) alive. ``cancel()``
returns at once, as ``Future.cancel()`` does, while the ranks are torn down (the same on
fakes, and the check that no private field of Future is used:
tests/unit/test_handle_future.py)."""

from __future__ import annotations

import concurrent.futures as cf
import gc
import os
import threading
import time

import pytest
import rankfns

from conftest import assert_no_survivors
from gangrun import DistributedCancelledError, DistributedError, distributed

pytestmark = pytest.mark.slow


def run2(fn, **opts):
    return distributed(processes=2, mlflow=False, timeout=60, **opts)(fn)


def _value_once(go: str, x: int) -> int:
    """Rank * x, once the test has created ``go`` (bounded by the call's timeout)."""
    import time

    while not os.path.exists(go):
        time.sleep(0.02)
    return int(os.environ["RANK"]) * x


def _join_monitor(run_id: str) -> None:
    """The call's monitor thread (which runs the done callbacks) has ended."""
    for t in threading.enumerate():
        if t.name == f"gangrun-run-{run_id}":
            t.join(30)
            assert not t.is_alive()


def test_wait_as_completed_results_errors_and_callbacks(tmp_path):
    go = tmp_path / "go"
    ok = run2(_value_once).submit(str(go), 3)
    bad = run2(rankfns.fail_on_rank1).submit("exit3", str(tmp_path))
    fired: list[tuple[object, str]] = []
    ok.add_done_callback(lambda f: fired.append((f, threading.current_thread().name)))
    assert not ok.cancelled() and not bad.cancelled()
    assert ok.running() and not ok.done()  # it waits for `go`
    go.touch()

    done, pending = cf.wait([ok, bad], timeout=120)
    assert pending == set() and done == {ok, bad}
    assert ok.done() and bad.done()  # wait() returning means done() is True
    assert not ok.running() and not bad.running()
    assert not ok.cancelled() and not bad.cancelled()
    assert {id(f) for f in cf.as_completed([ok, bad], timeout=5)} == {id(ok), id(bad)}

    assert ok.exception() is None
    assert ok.result(timeout=1) == [0, 3]
    err = bad.exception(timeout=1)
    assert isinstance(err, DistributedError) and err.rank == 1 and err.exitcode == 3
    assert err.handle is bad
    with pytest.raises(DistributedError) as ei:
        bad.result()
    assert ei.value is err

    _join_monitor(ok.run_id)
    assert fired == [(ok, f"gangrun-run-{ok.run_id}")]  # once, in the call's own thread
    late: list[object] = []
    bad.add_done_callback(late.append)  # added after the end: runs at once, here
    assert late == [bad]
    assert_no_survivors()


def test_first_completed_then_cancel_with_a_reason(tmp_path):
    slow = run2(rankfns.sleeper).submit(str(tmp_path), 60)
    fast = run2(rankfns.rank).submit()
    assert slow.running() and not slow.done()
    done, pending = cf.wait([slow, fast], timeout=120, return_when=cf.FIRST_COMPLETED)
    assert done == {fast} and pending == {slow}
    assert fast.result() == [0, 1]
    with pytest.raises(TimeoutError):
        slow.exception(timeout=0.1)

    completed = cf.as_completed([fast, slow], timeout=60)
    assert next(completed) is fast
    assert slow.cancel(wait=30, reason="stopped by the test") is True
    assert next(completed) is slow  # the pending future's waiter was told of the cancel
    assert slow.cancelled() and slow.done() and not slow.running()
    err = slow.exception()
    assert isinstance(err, DistributedCancelledError) and "stopped by the test" in str(err)
    with pytest.raises(DistributedCancelledError):
        slow.result()
    assert slow.cancel() is False  # already ended
    assert_no_survivors()


def test_a_failed_call_with_a_callback_leaves_nothing_once_dropped(tmp_path):
    seen = threading.Event()
    h = run2(rankfns.fail_on_rank1).submit("exit3", str(tmp_path))
    h.add_done_callback(lambda f: seen.set())
    cf.wait([h], timeout=60)
    err = h.exception()
    assert isinstance(err, DistributedError)
    run_dir = os.path.dirname(h.log_dir)
    run_id = h.run_id
    assert seen.wait(10)
    _join_monitor(run_id)
    assert os.path.isdir(run_dir)  # the logs stay while the handle (or its error) lives
    del h, err
    gc.collect()
    assert not os.path.exists(run_dir)
    assert_no_survivors()


def test_cancel_returns_at_once_while_the_ranks_go_down(tmp_path):
    """Ranks deaf to SIGTERM take the whole grace period to go: ``cancel()`` does not wait for
    them, ``result()`` does; the error is also a ``concurrent.futures.CancelledError``."""
    h = run2(rankfns.slow_to_stop, grace_period=3).submit(str(tmp_path))
    deadline = time.monotonic() + 30
    while len(list(tmp_path.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(list(tmp_path.iterdir())) == 2, "the ranks did not start"
    t0 = time.monotonic()
    assert h.cancel() is True
    assert time.monotonic() - t0 < 1.5  # not the 3 s grace period
    assert not h.done() and h.running() and not h.cancelled()  # the ranks are going down
    with pytest.raises(cf.CancelledError) as ei:  # what a plain Future's caller catches
        h.result(timeout=60)
    assert isinstance(ei.value, DistributedCancelledError)
    assert time.monotonic() - t0 >= 2.5  # result() waited for the teardown
    assert h.cancelled() and h.done() and not h.running()
    assert_no_survivors()
