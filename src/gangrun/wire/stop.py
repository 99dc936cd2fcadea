"""A preemption's files in the run directory: the caller's stop request, its teardown mark, and
each rank's "stopped" record.

``stop.request`` (`StopRequest`, written by the caller: ``handle.cancel(checkpoint=True)`` or
a SIGTERM to the caller) asks every rank to checkpoint and stop; a rank only looks whether it
exists (one ``stat`` per step, `gangrun.rank.stop`). ``stop.teardown`` (empty) says the caller
is tearing the gang down, so a SIGTERM that finds it means "die now". ``stop.<rank>.json``
(`Stopped`, written by a rank's `gangrun.Checkpointer` once it saved) tells the caller where
the rank saved and at which step (`gangrun.lifecycle.checkpoints.preempted_error`).
"""

from __future__ import annotations

import json
import os
import time as _time
from dataclasses import asdict, dataclass
from typing import Any

from .rundir import RunDir


@dataclass(frozen=True)
class StopRequest:
    """``stop.request``: when the caller asked."""

    time: float

    def to_text(self) -> str:
        return f"{self.time:.6f}\n"

    @classmethod
    def from_text(cls, text: str) -> StopRequest | None:
        try:
            return cls(time=float(text.split()[0]))
        except (IndexError, ValueError):
            return None


def request(rundir: RunDir, at: float | None = None) -> StopRequest:
    """Ask the ranks to checkpoint and stop. Raises ``OSError``."""
    req = StopRequest(time=_time.time() if at is None else at)
    with open(rundir.stop_request, "w") as f:
        f.write(req.to_text())
    return req


def requested(rundir: RunDir) -> bool:
    """The caller asked the ranks to stop (cheap: one ``stat``)."""
    return os.path.exists(rundir.stop_request)


def read_request(rundir: RunDir) -> StopRequest | None:
    try:
        with open(rundir.stop_request) as f:
            return StopRequest.from_text(f.read(64))
    except OSError:
        return None


def mark_teardown(rundir: RunDir) -> None:
    """Say the gang is being torn down: a rank's SIGTERM from now on means "die". Raises
    ``OSError``."""
    os.close(os.open(rundir.stop_teardown, os.O_WRONLY | os.O_CREAT, 0o600))


def tearing_down(rundir: RunDir) -> bool:
    return os.path.exists(rundir.stop_teardown)


@dataclass(frozen=True)
class Stopped:
    """``stop.<rank>.json``: the rank saved ``step`` to ``checkpoint`` and stopped."""

    step: int | None = None
    checkpoint: str | None = None
    time: float = 0.0
    mlflow_run_id: str | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Stopped:
        """Whichever version wrote it: unknown keys ignored, missing or mistyped ones
        defaulted."""

        def opt(kind: type, value: Any) -> Any:
            try:
                return None if value is None else kind(value)
            except (TypeError, ValueError):
                return None

        return cls(
            step=opt(int, raw.get("step")),
            checkpoint=opt(str, raw.get("checkpoint")),
            time=opt(float, raw.get("time")) or 0.0,
            mlflow_run_id=opt(str, raw.get("mlflow_run_id")),
        )


def write_stopped(rundir: RunDir, rank: int, record: Stopped) -> None:
    """Raises ``OSError``."""
    with open(rundir.stopped(rank), "w") as f:
        f.write(record.to_json())


def read_stopped(rundir: RunDir, rank: int) -> Stopped | None:
    """Rank ``rank``'s record, or None (it did not stop after saving, or a torn write)."""
    try:
        with open(rundir.stopped(rank)) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return None
    return Stopped.from_dict(raw) if isinstance(raw, dict) else None


__all__ = [
    "StopRequest",
    "Stopped",
    "mark_teardown",
    "read_request",
    "read_stopped",
    "request",
    "requested",
    "tearing_down",
    "write_stopped",
]
