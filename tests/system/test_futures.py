"""`RunHandle` is a `concurrent.futures.Future`: `wait`, `as_completed`, `exception()` and
`add_done_callback()` work on handles of real calls (issue 23 item 7)."""

from __future__ import annotations

import concurrent.futures
import threading

import pytest

import gangrun
from conftest import assert_no_survivors

pytestmark = pytest.mark.slow


def _value(x: int) -> int:
    import os

    return x * 10 + int(os.environ["RANK"])


def _fails() -> None:
    import os

    if os.environ["RANK"] == "1":
        raise ValueError("rank 1 fails on purpose")


def test_wait_as_completed_exception_and_callbacks():
    fn = gangrun.distributed(processes=2, mlflow=False)
    h1 = fn(_value).submit(1)
    h2 = fn(_value).submit(2)
    h3 = fn(_fails).submit()
    fired: list[object] = []
    seen = threading.Event()
    h1.add_done_callback(lambda f: (fired.append(f), seen.set()))
    done, pending = concurrent.futures.wait([h1, h2, h3], timeout=120)
    assert pending == set() and done == {h1, h2, h3}
    assert sorted(f.result() for f in concurrent.futures.as_completed([h1, h2], timeout=10)) == [
        [10, 11],
        [20, 21],
    ]
    assert h1.exception() is None and not h1.running()
    err = h3.exception(timeout=10)
    assert isinstance(err, gangrun.DistributedError) and err.rank == 1
    assert err.handle is h3
    with pytest.raises(gangrun.DistributedError, match="rank 1 fails on purpose"):
        h3.result()
    assert seen.wait(10) and fired == [h1]
    late: list[object] = []
    h2.add_done_callback(late.append)  # added after the end: runs at once
    assert late == [h2]
    assert_no_survivors()


def test_a_cancelled_call_completes_its_future():
    fn = gangrun.distributed(processes=2, mlflow=False)

    def sleeps() -> None:
        import time

        time.sleep(60)

    h = fn(sleeps).submit()
    assert h.running()
    assert h.cancel() is True
    done, _ = concurrent.futures.wait([h], timeout=30)
    assert done == {h}
    assert isinstance(h.exception(), gangrun.DistributedCancelledError)
    assert_no_survivors()
