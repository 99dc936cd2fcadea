"""The restart policy: after an attempt ends, relaunch the gang or stop the call.

A failed or hung attempt is retried while ``max_restarts`` allows (the function resumes from
its own checkpoints); a timeout or a cancel never is: the user asked for the call to end.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .state import State


class Decision(enum.Enum):
    RESTART = "restart"
    STOP = "stop"


RETRYABLE = frozenset({State.FAILED, State.HUNG})


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 0

    def decide(self, ended_in: State, restarts_so_far: int) -> Decision:
        """``ended_in``: the state the attempt would end the call in."""
        if ended_in in RETRYABLE and restarts_so_far < self.max_restarts:
            return Decision.RESTART
        return Decision.STOP


__all__ = ["Decision", "RestartPolicy", "RETRYABLE"]
