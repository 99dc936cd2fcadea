"""MLflow tracking for a call (mlflow is imported lazily, only when tracking is on).

Interface used by the run: ``Tracker.start(info)`` before launch (returns ``None`` when MLflow
is unavailable), ``tracker.rank_env()`` for the ranks, ``tracker.finish(status, error, logs)``
once the call is over. Only the caller ever ends the run.
"""

from __future__ import annotations

from typing import Any


class Tracker:
    run_id: str | None = None

    @classmethod
    def start(cls, info: dict[str, Any], stdout: Any) -> Tracker | None:
        return None

    def rank_env(self) -> dict[str, str]:
        return {}

    def finish(self, status: str, error: BaseException | None, log_files: dict[int, str]) -> None:
        pass
