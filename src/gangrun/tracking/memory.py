"""Each rank's memory among the call's MLflow system metrics: a monitor that MLflow's
``SystemMetricsMonitor`` (started by `gangrun.tracking.caller.Tracker` with
``log_system_metrics``) polls with its own, reading the ranks' last memory samples from the
run directory (`gangrun.wire.memory`). Metrics ``system/rank_<r>_memory_rss_megabytes``,
``..._memory_limit_percentage``, ``..._cuda_allocated_megabytes``,
``..._cuda_reserved_megabytes`` (names: `gangrun.wire.tags`), averaged over each logging
interval as MLflow does for its own."""

from __future__ import annotations

from collections import defaultdict

from ..wire import memory as memory_file
from ..wire.tags import RANK_MEMORY_METRICS, RANK_METRIC

_MB = 1e6  # MLflow's own "megabytes" are 10^6 bytes


class RankMemoryMonitor:
    """The interface of MLflow's ``BaseMetricsMonitor`` (``collect_metrics``,
    ``aggregate_metrics``, ``clear_metrics``, ``metrics``), for the ranks of one call."""

    def __init__(self, run_dir: str, world_size: int) -> None:
        self.run_dir = run_dir
        self.world_size = world_size
        self._metrics: defaultdict[str, list[float]] = defaultdict(list)

    @property
    def metrics(self) -> dict[str, list[float]]:
        return self._metrics

    def collect_metrics(self) -> None:
        rss, share, allocated, reserved = RANK_MEMORY_METRICS
        for r, s in memory_file.read_all(self.run_dir, self.world_size).items():
            values = {
                rss: s.rss / _MB,
                share: None if s.share is None else 100 * s.share,
                allocated: None if s.cuda_allocated is None else s.cuda_allocated / _MB,
                reserved: None if s.cuda_reserved is None else s.cuda_reserved / _MB,
            }
            for name, v in values.items():
                if v is not None:
                    self._metrics[RANK_METRIC.format(rank=r, name=name)].append(v)

    def aggregate_metrics(self) -> dict[str, float]:
        return {k: round(sum(v) / len(v), 1) for k, v in self._metrics.items() if v}

    def clear_metrics(self) -> None:
        self._metrics.clear()


__all__ = ["RankMemoryMonitor"]
