"""The run directory: one class owns its layout (the files the caller and ranks exchange).

``<tmp>/gangrun-<run_id>-XXXX/`` (0700, files 0600, written atomically by temp name + rename)::

    payload.pkl          the function and its arguments (cloudpickle), written once
    call.json            the call's record for `gangrun ps` (`gangrun.lifecycle.control`)
    control              the caller's control socket (`gangrun stop/stacks`)
    context.json         the rank context (`RankContext`): caller's sys.path, cwd, ...
    result.<rank>.pkl    what rank <rank> returned
    error.<rank>.pkl     rank <rank>'s failure record (exception type, message, traceback)
    heartbeat.<rank>     hang guard: touched by the rank on progress
    stacks.<rank>        hang guard: the rank's stacks, dumped on request
    progress.<rank>      the rank's last step report (`gangrun.rank.progress`)
    memory.<rank>        the rank's last memory sample (`gangrun.rank.memory`)
    collectives.<rank>   the rank's last torch.distributed calls (`gangrun.wire.collectives`)
    flight.<rank>        torch's Flight Recorder entries, dumped on request (`gangrun.wire.flight`)
    flight.request       the caller asks for those dumps (its mtime)
    stop.request         the caller asks the ranks to checkpoint and stop (a preemption)
    stop.teardown        the caller is tearing the gang down: a SIGTERM now means "die"
    stop.<rank>.json     rank <rank> saved a checkpoint and stopped (preempted)
    logs/rank-<rank>.log every rank's full output (unless ``log_dir=`` puts it elsewhere)

Both sides use this class: the caller creates and clears it, a rank only reads the payload and
context and writes its own result/error/heartbeat/stacks files.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass

from .records import RankContext

log = logging.getLogger("gangrun.wire.rundir")

PAYLOAD = "payload.pkl"
CONTEXT = "context.json"
CALL_RECORD = "call.json"
CONTROL_SOCKET = "control"
_ATTEMPT_PREFIXES = (
    "result.",
    "error.",
    "heartbeat.",
    "stacks.",
    "progress.",
    "memory.",
    "stop.",
    "collectives.",
    "flight.",
)


@dataclass(frozen=True)
class RunDir:
    path: str
    log_dir: str = ""

    @property
    def logs(self) -> str:
        return self.log_dir or os.path.join(self.path, "logs")

    @property
    def payload(self) -> str:
        return os.path.join(self.path, PAYLOAD)

    @property
    def context(self) -> str:
        return os.path.join(self.path, CONTEXT)

    @property
    def call_record(self) -> str:
        return os.path.join(self.path, CALL_RECORD)

    @property
    def control_socket(self) -> str:
        return os.path.join(self.path, CONTROL_SOCKET)

    def result(self, rank: int) -> str:
        return os.path.join(self.path, f"result.{rank}.pkl")

    def error(self, rank: int) -> str:
        return os.path.join(self.path, f"error.{rank}.pkl")

    def heartbeat(self, rank: int) -> str:
        return os.path.join(self.path, f"heartbeat.{rank}")

    def stacks(self, rank: int) -> str:
        return os.path.join(self.path, f"stacks.{rank}")

    def progress(self, rank: int) -> str:
        return os.path.join(self.path, f"progress.{rank}")

    def memory(self, rank: int) -> str:
        return os.path.join(self.path, f"memory.{rank}")

    def collectives(self, rank: int) -> str:
        return os.path.join(self.path, f"collectives.{rank}")

    def flight(self, rank: int) -> str:
        return os.path.join(self.path, f"flight.{rank}")

    @property
    def flight_request(self) -> str:
        return os.path.join(self.path, "flight.request")

    def log(self, rank: int) -> str:
        return log_path(self.logs, rank)

    @property
    def stop_request(self) -> str:
        return os.path.join(self.path, "stop.request")

    @property
    def stop_teardown(self) -> str:
        return os.path.join(self.path, "stop.teardown")

    def stopped(self, rank: int) -> str:
        return os.path.join(self.path, f"stop.{rank}.json")

    def attempt_files(self) -> list[str]:
        """The per-attempt files present now (results, errors, heartbeats, stacks, step
        reports)."""
        try:
            names = os.listdir(self.path)
        except FileNotFoundError:
            return []
        return [os.path.join(self.path, n) for n in names if n.startswith(_ATTEMPT_PREFIXES)]

    def clear_attempt(self) -> None:
        """Remove the per-attempt files (before a restart, and when the call ends)."""
        for path in self.attempt_files():
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass  # a rank's own clean-up got there first

    def write_context(self, ctx: RankContext) -> None:
        try:
            fd = os.open(self.context, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(ctx.to_json())
        except OSError as exc:
            _raise_if_full("the call's context", self.context, exc)
            raise

    def read_context(self) -> RankContext:
        with open(self.context) as f:
            return RankContext.from_json(f.read())

    def remove(self) -> None:
        # a late writer (an output pump's last line, a record rewritten as the call ends) can
        # create a file while the tree is removed, and the directory then stays: try again
        for _ in range(5):
            shutil.rmtree(self.path, ignore_errors=True)
            if not os.path.lexists(self.path):
                return
            time.sleep(0.05)


def create(run_id: str, log_dir: str | None) -> RunDir:
    """Make a fresh private run directory (0700) and its log directory. On failure nothing
    is left behind."""
    try:
        path = tempfile.mkdtemp(prefix=f"gangrun-{run_id}-")
    except OSError as exc:
        _raise_if_full("the run directory", tempfile.gettempdir(), exc)
        raise
    try:
        os.chmod(path, 0o700)
        from .security import make_private_dir

        if log_dir:  # refuses a path planted by another user (docs/security.md)
            logs = make_private_dir(os.path.join(os.path.abspath(log_dir), run_id))
        else:
            logs = os.path.join(path, "logs")
            os.mkdir(logs, 0o700)
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
    return RunDir(path, logs)


def _raise_if_full(what: str, path: str, exc: OSError) -> None:
    """A run-directory file the caller could not write for want of room: a
    [`LaunchError`][gangrun.errors.LaunchError] that says so (other errors are left as they are)."""
    from .diskfull import full_message, is_full
    from .errors import LaunchError

    if is_full(exc):
        raise LaunchError("gangrun " + full_message(what, path, exc)) from exc


def log_path(log_dir: str, rank: int) -> str:
    """Where rank ``rank``'s full output is kept."""
    return os.path.join(log_dir, f"rank-{rank}.log")
