"""The rank entry point.

A rank process (fresh interpreter or forked from the warm fork server) runs `main`:
watch the caller's liveness pipe, adopt the caller's ``sys.path`` and working directory, load
the payload, call the function, hand the result (or the error) back through an atomically
renamed file in the private run directory, flush stdio and leave with ``os._exit``.

Why ``os._exit``: interpreter finalisation is where gloo's runloop thread sometimes aborts the
process (``terminate called without an active exception``) and where MLflow's atexit hook
would end the caller's run. Once the result is safely on disk nothing in finalisation is
worth running.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable

from ..host import system as platform
from ..wire import contract
from ..wire.records import ErrorRecord, RankContext, user_frame
from ..wire.rundir import RunDir

# Functions called (in order) right before a rank exits; e.g. flush MLflow's async queue.
before_exit: list[Callable[[], None]] = []


def result_path(run_dir: str, rank: int) -> str:
    return RunDir(run_dir).result(rank)


def error_path(run_dir: str, rank: int) -> str:
    return RunDir(run_dir).error(rank)


def _kill_own_tree() -> None:
    """Caller is gone: kill every descendant and this rank's process group, then exit."""
    try:
        import psutil

        for child in psutil.Process().children(recursive=True):
            try:
                child.kill()
            except Exception:  # exited meanwhile, or not ours: nothing more to do
                pass
    except Exception:  # psutil missing or /proc unreadable: the process group kill remains
        pass
    try:
        if os.getpgrp() == os.getpid():
            os.killpg(os.getpid(), signal.SIGKILL)
    finally:
        os._exit(128 + signal.SIGKILL)


def watch_liveness(*fds: int) -> None:
    """One thread for every liveness pipe (the caller's; a forked rank's fork server's): the
    end of any of them (its process died) kills this rank's tree."""
    import select

    try:
        p = select.poll()
        for fd in fds:
            p.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        while True:
            for fd, _ in p.poll():
                if not os.read(fd, 64):
                    raise EOFError
    except (OSError, EOFError):  # a broken pipe is a closed caller as well
        pass
    _kill_own_tree()


_liveness_fd = -1
_also_watched: list[int] = []  # a forked rank: the fork server's liveness pipe (`also_watch`)


def also_watch(fd: int) -> None:
    """Before `main`: the liveness thread also watches ``fd`` (the fork server's pipe)."""
    os.set_inheritable(fd, False)
    _also_watched.append(fd)


def caller_gone() -> bool:
    """True when the caller's end of the liveness pipe is closed (the caller died)."""
    if _liveness_fd < 0:
        return False
    import select

    try:
        p = select.poll()
        p.register(_liveness_fd, select.POLLIN | select.POLLHUP)
        return bool(p.poll(0))
    except (OSError, ValueError):
        return False


def start_liveness_watchdog() -> None:
    global _liveness_fd
    fds = list(_also_watched)
    fd_s = os.environ.get(contract.LIVENESS_FD)
    if fd_s:
        try:
            os.set_inheritable(int(fd_s), False)
            _liveness_fd = int(fd_s)
            fds.insert(0, _liveness_fd)
        except OSError:
            pass
    if fds:
        t = threading.Thread(target=watch_liveness, args=fds, name="gangrun-liveness", daemon=True)
        t.start()


def _format_tb(exc: BaseException) -> str:
    """The traceback without gangrun's own frames on top (the user's code first)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__ and tb.tb_next is not None:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _message(exc: BaseException) -> str:
    """``str(exc)``, or a note when the exception's ``__str__`` itself fails."""
    try:
        return str(exc)
    except Exception as inner:
        return (
            f"<the message of this {type(exc).__name__} could not be rendered: its __str__ "
            f"raised {type(inner).__name__}>"
        )


def error_record(
    rank: int, exc: BaseException, tb_text: str, *, exitcode: int | None = None
) -> ErrorRecord:
    from ..wire import serialization

    exc_bytes: bytes | None
    try:
        exc_bytes = serialization.dumps(exc)
        import pickle

        pickle.loads(exc_bytes)  # an exception whose __init__ needs other args can't come back
    except Exception:
        exc_bytes = None
    from .memory import cuda_oom_note

    message, note = _message(exc), cuda_oom_note(exc)  # a CUDA OOM: the device's figures
    return ErrorRecord(
        rank=rank,
        exc_type=f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins."),
        message=f"{message}\n{note}" if note else message,
        traceback=tb_text,
        time=time.time(),
        pid=os.getpid(),
        exitcode=exitcode,
        exc=exc_bytes,
        frame=user_frame(exc),
    )


def _write_error(run_dir: str, rank: int, record: ErrorRecord) -> None:
    from dataclasses import replace

    from ..wire import diskfull, serialization

    path = error_path(run_dir, rank)
    try:
        try:
            serialization.atomic_dump(record, path)
        except OSError:
            raise
        except Exception:  # the exception itself would not pickle: keep the text only
            serialization.atomic_dump(replace(record, exc=None), path)
    except OSError as exc:  # no room (or no directory): the caller judges by the exit code
        what = (
            diskfull.full_message("its error record", path, exc)
            if diskfull.is_full(exc)
            else f"could not write its error record {path}: {exc}"
        )
        try:
            print(f"gangrun: rank {rank} {what}", file=sys.stderr)
        except Exception:  # stderr gone too: the exit code is all that is left
            pass


def _flush_and_exit(code: int) -> None:
    if caller_gone():
        # The caller died and the rank ends on its own (e.g. a broken stdout pipe) before the
        # watchdog acted: take the rank's descendants along, as the watchdog would.
        _kill_own_tree()
    for hook in before_exit:
        try:
            hook()
        except Exception:
            traceback.print_exc()
    try:
        logging.shutdown()
    except Exception:  # a broken handler must not keep the rank from exiting
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # the caller's end of the pipe may be gone
            pass
    platform.flush_c_stdio()  # printf from C code: os._exit skips C stdio's flush
    os._exit(code)


def setup_context(run_dir: str) -> None:
    ctx: RankContext = RunDir(run_dir).read_context()
    own = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = list(ctx.sys_path)
    if own not in paths:
        paths.append(own)
    sys.path[:] = paths
    try:
        os.chdir(ctx.cwd)
    except OSError as exc:
        print(f"gangrun: cannot enter the caller's directory {ctx.cwd!r}: {exc}", file=sys.stderr)
    sys.argv = list(ctx.argv or [""])


def run_rank(run_dir: str, rank: int) -> int:
    """Load the payload, run it, hand the outcome back. Returns the exit code."""
    from ..wire import serialization

    try:
        setup_context(run_dir)
        from ..wire.security import load_private

        fn, args, kwargs = load_private(RunDir(run_dir).payload)
        result = fn(*args, **kwargs)
    except SystemExit as exc:
        code = exc.code
        if code is None or code == 0:
            # Ended on purpose without returning: the caller decides whether that is fine
            # (every rank did so, e.g. a script ending in sys.exit(0)) or the root cause of a
            # failure (its peers were still waiting for it).
            _write_error(run_dir, rank, error_record(rank, exc, "", exitcode=0))
            return 0
        if not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
        tb = _format_tb(exc)
        _write_error(run_dir, rank, error_record(rank, exc, tb, exitcode=code))
        return int(code) & 0xFF or 1
    except BaseException as exc:
        tb = _format_tb(exc)
        try:
            sys.stderr.write(tb)
        except Exception:  # stderr gone: the error record below still reaches the caller
            pass
        _write_error(run_dir, rank, error_record(rank, exc, tb))
        return 1
    try:
        serialization.atomic_dump(result, result_path(run_dir, rank))
    except BaseException as exc:
        from ..wire import diskfull

        if diskfull.is_full(exc):  # the run directory's disk, not the value
            return _result_not_written(run_dir, rank, exc)
        msg = (
            f"rank {rank} returned a value that cannot be serialized "
            f"({type(result).__module__}.{type(result).__qualname__}): "
            f"{type(exc).__name__}: {exc}. Return plain data (numbers, lists, dicts, CPU "
            "tensors, a state_dict) or save large objects to a file and return its path."
        )
        tb = traceback.format_exc()
        print(msg, file=sys.stderr)
        from dataclasses import replace

        rec = error_record(rank, TypeError(msg), tb)
        _write_error(run_dir, rank, replace(rec, exc_type="ResultSerializationError"))
        return 1
    return 0


def _result_not_written(run_dir: str, rank: int, exc: BaseException) -> int:
    """The result could not be written: no room on the run directory's disk. The error says
    so, names the directory, and keeps the ``OSError`` as its cause."""
    from dataclasses import replace

    from ..wire import diskfull

    msg = f"rank {rank} " + diskfull.full_message("its result", run_dir, exc)
    try:
        print(msg, file=sys.stderr)
    except Exception:  # stderr gone: the error record below still reaches the caller
        pass
    rec = error_record(rank, exc, _format_tb(exc))
    _write_error(run_dir, rank, replace(rec, message=msg))
    return 1


def main() -> None:
    faulthandler.enable(all_threads=True)
    start_liveness_watchdog()
    from .tracking import RankRuns

    rank_runs = RankRuns()  # notes the call's MLFLOW_RUN_ID before user code can consume it
    run_dir = os.environ[contract.RUN_DIR]
    rank = int(os.environ["RANK"])
    from .progress import bind

    bind(run_dir, rank)
    from .stacks import install as install_stacks

    install_stacks(run_dir, rank)  # handle.stacks(), `gangrun stacks`, the hang guard
    from .collectives import install as record_collectives
    from .memory import start as sample_memory

    sample_memory(run_dir, rank)  # the panel, `gangrun ps`, the out-of-memory verdict
    record_collectives(run_dir, rank)  # where the rank is in torch.distributed: the verdict
    if os.environ.get(contract.HANG_TIMEOUT):
        from .heartbeat import install

        install(run_dir, rank)
    code = run_rank(run_dir, rank)
    from .progress import flush

    flush()  # the last step report, if the throttle held it back
    before_exit.insert(0, lambda: rank_runs.end(succeeded=code == 0))
    _flush_and_exit(code)


if __name__ == "__main__":  # pragma: no cover
    main()
