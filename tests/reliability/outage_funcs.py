"""Functions the outage tests run on ranks. A module of their own: unpickling a function
of a test module in a rank would import ``conftest``, which points ``MLFLOW_TRACKING_URI``
at the session's sqlite store."""

from __future__ import annotations


def waits_for(flag: str) -> int:
    """Waits (bounded) until ``flag`` exists; returns the rank."""
    import os
    import time

    deadline = time.monotonic() + 90
    while not os.path.exists(flag):
        assert time.monotonic() < deadline, f"{flag} never appeared"
        time.sleep(0.02)
    return int(os.environ["RANK"])


def logs_through_an_outage(flags: str, seconds: float) -> dict:
    """Logs a metric while the server is up, says so, waits for the outage, then keeps
    logging (a training loop) for ``seconds``; returns how long the logging calls took."""
    import os
    import time

    import mlflow

    rank = int(os.environ["RANK"])
    mlflow.log_metric(f"loss{rank}", 1.0, step=0)
    mlflow.flush_async_logging()  # the first point is on the server
    open(os.path.join(flags, f"logged.{rank}"), "w").close()
    deadline = time.monotonic() + 90
    while not os.path.exists(os.path.join(flags, "killed")):
        assert time.monotonic() < deadline, "the server was not killed"
        time.sleep(0.02)
    slowest, step, end = 0.0, 1, time.monotonic() + seconds
    while time.monotonic() < end:  # training goes on, logging every step
        t = time.monotonic()
        mlflow.log_metric(f"loss{rank}", 1.0 / (step + 1), step=step)
        slowest = max(slowest, time.monotonic() - t)
        step += 1
        time.sleep(0.05)
    return {"rank": rank, "steps": step, "slowest_log": slowest}


def quick(x: int) -> int:
    import os

    return x + int(os.environ["RANK"])


def reports_pid_and_sleeps(flags: str) -> int:
    """Writes ``pid.<rank>`` and sleeps (bounded): a call to kill things under."""
    import os
    import time

    rank = int(os.environ["RANK"])
    path = os.path.join(flags, f"pid.{rank}")
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(path + ".tmp", path)
    time.sleep(60)
    return rank


def returns_bytes(n: int) -> bytes:
    """A return value of ``n`` bytes (the result file needs that much room)."""
    return b"r" * n


def fills_then_raises() -> int:
    """Rank 1 fills the disk of its run directory, then raises: its error record has no room
    left. Rank 0 waits (bounded) to be stopped."""
    import os
    import time

    if int(os.environ["RANK"]) == 1:
        fd = os.open(
            os.path.join(os.environ["GANGRUN_RUN_DIR"], "filler"), os.O_WRONLY | os.O_CREAT
        )
        size = 0
        try:  # block by block until the disk says no (tmpfs undoes a failed fallocate)
            while size < 1 << 30:
                os.posix_fallocate(fd, size, 1 << 14)
                size += 1 << 14
        except OSError:
            pass
        finally:
            os.close(fd)
        raise RuntimeError("rank 1 gives up " + "x" * 100000)  # a record too big to fit
    time.sleep(60)
    return 0


def logs_and_reads_its_call_record() -> str:
    """Logs a metric to the call's run and returns the caller's ``call.json`` as it is now
    (what ``gangrun ps --json`` shows)."""
    import os

    import mlflow

    rank = int(os.environ["RANK"])
    mlflow.log_metric(f"cred{rank}", 1.0, step=0)
    with open(os.path.join(os.environ["GANGRUN_RUN_DIR"], "call.json")) as f:
        return f.read()
