"""The output pump's folding (pipes, no processes): a peer's death echoed
in a traceback is one line, other tracebacks pass unchanged, and calls sharing a place name
themselves (the end-to-end tests: ``tests/system/test_quiet_output.py``)."""

from __future__ import annotations

import io
import os
import time

from gangrun.output import OutputPump
from gangrun.output_fold import HOLD_S, Fold
from gangrun.wire.stacks import user_threads_first

ECHO_TB = (
    "Traceback (most recent call last):\n"
    '  File "/x/train.py", line 9, in train\n'
    "    dist.all_reduce(t)\n"
    '  File "/site-packages/gangrun/rank/checkpointer.py", line 80, in save\n'
    "    work.wait()\n"
    "RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:5\n"
)
OWN_TB = (
    "Traceback (most recent call last):\n"
    '  File "/x/train.py", line 3, in train\n'
    '    raise ValueError("broken")\n'
    "ValueError: broken\n"
)


def _pump(out, name="", run_id=""):
    pump = OutputPump(out, io.StringIO(), "all", name=name, run_id=run_id)
    ends = {}
    for rank in (0, 1):
        r, w = os.pipe()
        log = io.BytesIO()
        log.close = lambda: None  # type: ignore[method-assign]
        pump.add(rank, "out", r, log)
        ends[rank] = (w, log)
    return pump, ends


def test_an_echo_traceback_is_one_line_and_the_log_keeps_it_all():
    out = io.StringIO()
    pump, ends = _pump(out)
    pump.start()
    os.write(ends[1][0], OWN_TB.encode())
    os.write(ends[0][0], b"step 3\n" + ECHO_TB[:50].encode())  # cut inside the traceback
    time.sleep(0.1)
    os.write(ends[0][0], ECHO_TB[50:].encode() + b"after\n")
    for w, _ in ends.values():
        os.close(w)
    pump.close(drain_timeout=5)
    lines = out.getvalue().splitlines()
    assert [ln for ln in lines if ln.startswith("[rank 1]")] == [
        "[rank 1] " + ln for ln in OWN_TB.splitlines()
    ]
    zero = [ln for ln in lines if ln.startswith("[rank 0]")]
    assert zero[0] == "[rank 0] step 3" and zero[2] == "[rank 0] after" and len(zero) == 3
    assert zero[1].startswith("[rank 0] RuntimeError: [../gloo/transport/tcp/pair.cc:534]")
    assert "a consequence: a peer went away; this rank's 6-line traceback" in zero[1]
    assert ends[0][1].getvalue() == b"step 3\n" + ECHO_TB.encode() + b"after\n"


def test_a_traceback_without_its_exception_line_is_shown_after_the_hold():
    fold = Fold()
    assert fold.feed("x\n" + ECHO_TB[:60], True) == "x\n"
    assert fold.holding and not fold.stale(time.monotonic())
    assert fold.stale(time.monotonic() + HOLD_S)
    assert fold.release() == ECHO_TB[:60] and not fold.holding
    # not at a line's start: not a traceback's beginning
    assert Fold().feed(ECHO_TB, False) == ECHO_TB
    # a chained traceback: each part judged on its own
    chained = OWN_TB + "\nDuring handling of the above exception, another exception occurred:\n\n"
    got = Fold().feed(chained + ECHO_TB, True)
    assert got.startswith(chained) and got.count("\n") == chained.count("\n") + 1
    assert "a consequence" in got


def test_calls_sharing_a_place_name_themselves_and_a_call_alone_does_not():
    shared = io.StringIO()
    alone, ends_alone = _pump(io.StringIO(), "main.<locals>.train", "aaaaaa111111")
    first, ends_first = _pump(shared, "main.<locals>.train", "aaaaaa111111")
    first.start()
    alone.start()
    os.write(ends_first[0][0], b"one\n")
    time.sleep(0.2)
    second, ends_second = _pump(shared, "train", "bbbbbb222222")
    third, ends_third = _pump(shared, "evaluate", "cccccc333333")
    second.start()
    third.start()
    os.write(ends_first[0][0], b"two\n")
    os.write(ends_second[1][0], b"three\n")
    os.write(ends_third[0][0], b"four\n")
    os.write(ends_alone[0][0], b"five\n")
    for p, ends in ((first, ends_first), (second, ends_second), (third, ends_third)):
        for w, _ in ends.values():
            os.close(w)
        p.close(drain_timeout=5)
    for w, _ in ends_alone.values():
        os.close(w)
    alone.close(drain_timeout=5)
    lines = set(shared.getvalue().splitlines())
    assert "[rank 0] one" in lines  # alone at the time
    assert "[train aaaaaa rank 0] two" in lines  # two calls of train: told apart by their id
    assert "[train bbbbbb rank 1] three" in lines
    assert "[evaluate rank 0] four" in lines
    assert alone._named == "" and "five" in ends_alone[0][1].getvalue().decode()


def test_gangruns_own_threads_are_listed_after_the_users():
    own = os.path.dirname(os.path.abspath(__import__("gangrun").__file__))
    dump = (
        "Thread 0x01 (most recent call first):\n"
        f'  File "{own}/rank/worker.py", line 71 in watch_liveness\n'
        '  File "/usr/lib/python3.11/threading.py", line 982 in run\n'
        "\n"
        "Thread 0x02 (most recent call first):\n"
        '  File "/x/train.py", line 5 in helper\n'
        '  File "/usr/lib/python3.11/threading.py", line 982 in run\n'
        "\n"
        "Current thread 0x03 (most recent call first):\n"
        '  File "/x/train.py", line 9 in train\n'
        f'  File "{own}/rank/worker.py", line 235 in run_rank\n'
    )
    got = user_threads_first(dump)
    assert [ln for ln in got.splitlines() if "0x0" in ln] == [
        "Thread 0x02 (most recent call first):",
        "Current thread 0x03 (most recent call first):",
        "Thread 0x01 (most recent call first):",
    ]
    assert sorted(got.split()) == sorted(dump.split())
