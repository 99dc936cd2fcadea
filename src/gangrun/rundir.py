"""The run directory: one class owns its layout (the files the caller and ranks exchange).

``<tmp>/gangrun-<run_id>-XXXX/`` (0700, files 0600, written atomically by temp name + rename)::

    payload.pkl          the function and its arguments (cloudpickle), written once
    context.json         the rank context (:class:`RankContext`): caller's sys.path, cwd, ...
    result.<rank>.pkl    what rank <rank> returned
    error.<rank>.pkl     rank <rank>'s failure record (exception type, message, traceback)
    heartbeat.<rank>     hang guard: touched by the rank on progress
    stacks.<rank>        hang guard: the rank's stacks, dumped on request
    logs/rank-<rank>.log every rank's full output (unless ``log_dir=`` puts it elsewhere)

Both sides use this class: the caller creates and clears it, a rank only reads the payload and
context and writes its own result/error/heartbeat/stacks files.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

PAYLOAD = "payload.pkl"
CONTEXT = "context.json"
_ATTEMPT_PREFIXES = ("result.", "error.", "heartbeat.", "stacks.")


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

    def result(self, rank: int) -> str:
        return os.path.join(self.path, f"result.{rank}.pkl")

    def error(self, rank: int) -> str:
        return os.path.join(self.path, f"error.{rank}.pkl")

    def heartbeat(self, rank: int) -> str:
        return os.path.join(self.path, f"heartbeat.{rank}")

    def stacks(self, rank: int) -> str:
        return os.path.join(self.path, f"stacks.{rank}")

    def log(self, rank: int) -> str:
        return log_path(self.logs, rank)

    def attempt_files(self) -> list[str]:
        """The per-attempt files present now (results, errors, heartbeats, stacks)."""
        try:
            names = os.listdir(self.path)
        except FileNotFoundError:
            return []
        return [os.path.join(self.path, n) for n in names if n.startswith(_ATTEMPT_PREFIXES)]


def log_path(log_dir: str, rank: int) -> str:
    """Where rank ``rank``'s full output is kept."""
    return os.path.join(log_dir, f"rank-{rank}.log")
