"""Rank side of tracking: metrics logged exactly once per step, whatever restarts
(``Checkpointer.log_metrics``), and the run's tag naming its newest checkpoint.

A metric for step ``s`` is buffered until the checkpoint that covers ``s`` is committed, then
logged to the call's MLflow run (``MLFLOW_RUN_ID``). What was buffered but not yet logged
travels in the checkpoint, and is logged again after a restore when the run does not have it
(`StepMetrics.replay`): a step replayed after a restore is in the run once, never twice,
never lost. Only rank 0's metrics are the run's. A tracking error never stops the training:
what was not logged stays buffered for the next flush (and the next checkpoint).

Cheap when nothing is logged: mlflow is imported on the first flush only.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

from ..wire.tags import TAG_LATEST  # set by rank 0 after each commit

Entry = tuple[int, int, dict[str, float]]  # (step, time in ms, metrics)


def _client() -> tuple[Any, str | None]:
    run_id = os.environ.get("MLFLOW_RUN_ID")
    if not run_id:
        return None, None
    try:
        from mlflow.tracking import MlflowClient
    except ImportError:
        return None, None
    return MlflowClient(), run_id


class StepMetrics:
    """The buffer of one manager's metrics, logged once the checkpoint covering them is
    committed."""

    def __init__(self) -> None:
        self.buffered: list[Entry] = []
        self._have: dict[str, set[int]] = {}  # steps the run has, per metric key
        self._warned = False

    def add(self, rank: int, step: int, ms: int, metrics: Mapping[str, float]) -> bool:
        """Buffer rank 0's ``metrics`` of ``step``; on another rank, warn once and ignore
        them (returns whether they were kept)."""
        if rank != 0:
            if not self._warned:
                self._warned = True
                print(
                    f"gangrun: Checkpointer.log_metrics on rank {rank} is ignored: rank 0's "
                    "metrics are logged, once per step (all_reduce a value first for a global "
                    "one; mlflow.log_metric logs a rank's own, live).",
                    file=sys.stderr,
                )
            return False
        self.buffered.append((int(step), ms, {k: float(v) for k, v in metrics.items()}))
        return True

    def before(self, step: int) -> list[Entry]:
        """The buffered metrics of the steps a checkpoint at ``step`` covers (it carries
        them: a restore logs those its run lacks)."""
        return [m for m in self.buffered if m[0] < step]

    def flush(self, before: int | None) -> None:
        """Log the buffered metrics of steps < ``before`` (all of them for ``None``)."""
        ready = [m for m in self.buffered if before is None or m[0] < before]
        if not ready:
            return
        self.buffered = [m for m in self.buffered if not (before is None or m[0] < before)]
        self._log(ready)

    def replay(self, entries: list[Any]) -> None:
        """Metrics a restored checkpoint covered but whose flush the previous attempt may not
        have reached: log the ones the run does not have yet."""
        self._log([(int(s), int(ms), dict(m)) for s, ms, m in entries])

    def _log(self, entries: list[Entry]) -> None:
        """Log ``entries`` but the (key, step) pairs the run has already: a step that an
        earlier attempt logged and this one redid (after a restore, or a loop left early and
        resumed) is in the run once. A tracking error does not stop the training: what was
        not logged stays buffered (and travels in the next checkpoint) for the next flush."""
        client, run_id = _client()
        if client is None:
            return
        from mlflow.entities import Metric

        todo = [(s, ms, k, v) for s, ms, m in entries for k, v in m.items()]
        done = 0
        try:
            for k in {t[2] for t in todo}:
                if k not in self._have:
                    self._have[k] = {x.step for x in client.get_metric_history(run_id, k)}
            todo = [t for t in todo if t[0] not in self._have[t[2]]]
            for i in range(0, len(todo), 1000):
                chunk = todo[i : i + 1000]
                client.log_batch(run_id, metrics=[Metric(k, v, ms, s) for s, ms, k, v in chunk])
                for s, _, k, _ in chunk:
                    self._have[k].add(s)
                done = i + len(chunk)
        except Exception as exc:  # tracking must not stop the training
            left: dict[tuple[int, int], dict[str, float]] = {}
            for s, ms, k, v in todo[done:]:
                left.setdefault((s, ms), {})[k] = v
            kept = [(s, ms, m) for (s, ms), m in left.items()] + self.buffered
            self.buffered = sorted(kept, key=lambda e: (e[0], e[1]))
            print(
                f"gangrun: could not log {len(todo) - done} metric value(s) to MLflow run "
                f"{run_id} ({type(exc).__name__}: {exc}); kept for the next flush.",
                file=sys.stderr,
            )


def tag_latest(url: str) -> None:
    """Name ``url`` the call's newest committed checkpoint on its MLflow run (rank 0, after
    each commit; a ``run_id=`` resume reads it back)."""
    client, run_id = _client()
    if client is not None:
        try:
            client.set_tag(run_id, TAG_LATEST, url)
        except Exception as exc:  # tracking must not stop the training
            print(f"gangrun: could not tag the MLflow run: {exc}", file=sys.stderr)


__all__ = ["Entry", "StepMetrics", "TAG_LATEST", "tag_latest"]
