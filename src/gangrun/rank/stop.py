"""Rank side of a preemption: has this rank been asked to checkpoint and stop?

Two ways a rank is asked:

* the caller writes ``stop.request`` in the run directory (``handle.cancel(checkpoint=True)``,
  or the caller itself got SIGTERM from a scheduler);
* someone outside sends the rank SIGTERM (a scheduler, ``kill``).

`should_stop` answers both, cheaply (a flag, then one ``stat`` of the request file).

A scheduler may signal every process of the job (SLURM does, and ``kill -TERM -<pgid>``),
DataLoader workers included. torch's workers die of any SIGTERM not sent by their parent, and
their death raises an error in the training loop (``DataLoader worker ... is killed by
signal: Terminated``) before the rank could save. So while a Checkpointer is active, the
DataLoader workers forked from the rank keep running on an outside SIGTERM (the rank saves,
then ends them as it ends its loaders); gangrun's own teardown still ends them at once.

The SIGTERM handler is installed only while a `gangrun.Checkpointer` is active (never
in a rank that does not checkpoint: there SIGTERM keeps its default, immediate death). Even
then a teardown stays immediate: gangrun's own teardown (a peer failed, a timeout, a plain
cancel) first writes ``stop.teardown``, and a SIGTERM that finds it kills the rank at once
with the default action, whatever the main thread is doing. That decision is taken on a
helper thread woken through `signal.set_wakeup_fd` (written by the C-level handler as
the signal arrives), not in the Python-level handler, which would run only once the main
thread returns from a blocking collective.
"""

from __future__ import annotations

import os
import signal
import threading

from ..wire import contract
from ..wire.rundir import RunDir
from ..wire.stop import requested, tearing_down

_flag = threading.Event()
_installed = False
_lock = threading.Lock()


def _run_dir() -> RunDir | None:
    path = os.environ.get(contract.RUN_DIR)
    return RunDir(path) if path else None


def should_stop() -> bool:
    """True once this rank has been asked to checkpoint and stop (a SIGTERM preemption, a
    ``handle.cancel(checkpoint=True)``, the caller preempted). Cheap: call it every step.

    A loop that saves on its own: save, then return (or ``sys.exit(0)``). Ranks may learn it
    at different steps; `gangrun.Checkpointer` makes them agree on one step."""
    if _flag.is_set():
        return True
    rd = _run_dir()
    if rd is not None and requested(rd):
        _flag.set()
        return True
    return False


def request() -> None:
    """Mark this rank as asked to stop (what a SIGTERM from outside does)."""
    _flag.set()


def _die_now() -> None:
    # Default disposition at the C level (signal.signal works only on the main thread),
    # then the same signal again: the rank ends as an unhandled SIGTERM would end it.
    from ..host.system import load_libc

    libc = load_libc()
    if libc is not None:
        libc.signal(signal.SIGTERM, 0)  # SIG_DFL
        os.kill(os.getpid(), signal.SIGTERM)
    os._exit(128 + signal.SIGTERM)


def _die_if_teardown() -> None:
    """gangrun's own teardown (or no run directory to tell): die at once, as SIGTERM would."""
    rd = _run_dir()
    if rd is None or tearing_down(rd):
        _die_now()


def _on_sigterm() -> None:
    _die_if_teardown()
    _flag.set()


def _watch(fd: int) -> None:
    while True:
        try:
            data = os.read(fd, 64)
        except InterruptedError:
            continue
        except OSError:
            return
        if not data:
            return
        if signal.SIGTERM in data:
            _on_sigterm()


def _python_handler(signum: int, frame: object) -> None:
    # The watcher thread has already decided; this runs later, on the main thread. If there
    # was no watcher (someone else owns the wakeup fd) decide here.
    if not _watching:
        _on_sigterm()


_watching = False


def install() -> bool:
    """Install the SIGTERM handler (main thread only; idempotent). False when it could not be
    (not the main thread): requests through the run directory still work."""
    global _installed, _watching
    with _lock:
        if _installed:
            return True
        if threading.current_thread() is not threading.main_thread():
            return False
        r, w = os.pipe()
        os.set_blocking(w, False)
        os.set_inheritable(r, False)
        os.set_inheritable(w, False)
        try:
            previous = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except (ValueError, OSError):
            previous = -2
        if previous not in (-1, -2):  # the fd belongs to someone else (an event loop): keep it
            signal.set_wakeup_fd(previous)
        if previous == -1:
            _watching = True
            threading.Thread(target=_watch, args=(r,), name="gangrun-sigterm", daemon=True).start()
        else:
            os.close(r)
            os.close(w)
        signal.signal(signal.SIGTERM, _python_handler)
        _guard_loader_workers()
        _installed = True
        return True


def _guard_loader_workers() -> None:
    """Make the DataLoader workers forked from now on keep running on an outside SIGTERM:
    torch sets each worker's signal handlers first thing (``_set_worker_signal_handlers``,
    looked up on its module at every worker start), then this process's policy applies."""
    try:
        from torch.utils.data._utils import signal_handling
    except Exception:  # no torch (or another layout): workers keep torch's own handlers
        return
    original = getattr(signal_handling, "_set_worker_signal_handlers", None)
    if original is None or getattr(original, "gangrun_guard", False):
        return

    def set_worker_signal_handlers(*args: object, **kwargs: object) -> None:
        original(*args, **kwargs)
        if _run_dir() is not None:
            signal.signal(signal.SIGTERM, _worker_sigterm)

    set_worker_signal_handlers.gangrun_guard = True  # type: ignore[attr-defined]
    signal_handling._set_worker_signal_handlers = set_worker_signal_handlers


def _worker_sigterm(signum: int, frame: object) -> None:
    """In a DataLoader worker of a checkpointing rank: gangrun's teardown ends it at once;
    any other SIGTERM (a scheduler signalling every process) leaves it to its rank."""
    _die_if_teardown()


def _reset_in_child() -> None:
    # A fork of the rank (a DataLoader worker): SIGTERM is its default again, and its signals
    # must not wake the rank's watcher through the inherited wakeup fd.
    global _installed, _watching
    if _installed:
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        except (ValueError, OSError):
            pass
    _flag.clear()
    _installed = _watching = False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_in_child)

__all__ = ["should_stop", "install", "request"]
