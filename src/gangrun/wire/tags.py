"""The names gangrun writes on an MLflow run: its tags, params and metrics, in one table.

A run outlives the call that made it: a later call (another process, another gangrun version)
resumes it by reading these tags back (the checkpoint location, the latest checkpoint, the
lease, the resume count), and the user's own tools query them. Every module that writes or
reads one uses the constant from here; `TABLE` says what each holds and who writes it.
"""

from __future__ import annotations

PREFIX = "gangrun."  # every tag and metric name of gangrun's starts with it

# what the call was (the caller, when it creates or resumes the run: gangrun.tracking.plan)
TAG_FUNCTION = "gangrun.function"
TAG_WORLD_SIZE = "gangrun.world_size"
TAG_VERSION = "gangrun.version"
TAG_HOST = "gangrun.host"
CALL_TAG_KEYS = ("processes", "gpus", "gpu_type", "timeout", "backend")  # "gangrun.<key>"
PARAM_KEYS = ("function", "world_size", "processes", "gpus", "gpu_type", "timeout")
TAG_RUN_ID = "gangrun.run_id"  # the gangrun call's id
TAG_RESUMES = "gangrun.resumes"  # how many calls resumed this run
TAG_LEASE = "gangrun.lease"  # the call that holds the run now (one writer per run)

# how it ended (the caller: gangrun.tracking.caller)
TAG_ERROR = "gangrun.error"
TAG_ERROR_TYPE = "gangrun.error_type"
TAG_ERROR_RANK = "gangrun.error_rank"
TAG_STATUS_REASON = "gangrun.status_reason"

# restarts (the caller: gangrun.lifecycle.attempts)
TAG_ATTEMPTS = "gangrun.attempts"  # how many attempts ran
TAG_RESTART_STOP = "gangrun.restarts_stopped"  # why the restarts stopped (a failed call)

# checkpoints
TAG_DIR = "gangrun.checkpoint_dir"  # the caller: the call's checkpoint location
TAG_LATEST = "gangrun.checkpoint_latest"  # rank 0, after each commit (gangrun.Checkpointer)

# progress (the caller, at the end of the call: gangrun.lifecycle.watch)
METRIC_PREFIX = PREFIX  # gangrun.step, gangrun.total_steps, gangrun.steps_per_second
TAG_SLOW_RANKS = "gangrun.slow_ranks"

# each rank's memory, among MLflow's system metrics (which add "system/" before them), while
# the call runs (gangrun.tracking.memory): rank_<r>_ then one of these
RANK_METRIC = "rank_{rank}_{name}"
RANK_MEMORY_METRICS = (
    "memory_rss_megabytes",  # resident memory of the rank's process tree
    "memory_limit_percentage",  # that against its limit (memory cgroup, else the RAM)
    "cuda_allocated_megabytes",  # torch.cuda.memory_allocated, with a GPU
    "cuda_reserved_megabytes",  # torch.cuda.memory_reserved
)

TABLE: dict[str, str] = {
    TAG_FUNCTION: "tag: the function the call ran",
    TAG_WORLD_SIZE: "tag: how many ranks",
    TAG_VERSION: "tag: the gangrun version of the call",
    TAG_HOST: "tag: the caller's host",
    PREFIX + "<processes|gpus|gpu_type|timeout|backend>": "tags: the call's options, when set",
    "<function|world_size|processes|gpus|gpu_type|timeout>": "params: the same, then the "
    "call's arguments by parameter name",
    TAG_RUN_ID: "tag: the gangrun call's id (handle.run_id)",
    TAG_RESUMES: "tag: how many calls resumed the run",
    TAG_LEASE: "tag: the call that holds the run (deleted when it ends)",
    TAG_ERROR: "tag: the error of a failed call",
    TAG_ERROR_TYPE: "tag: its type",
    TAG_ERROR_RANK: "tag: the rank it came from",
    TAG_STATUS_REASON: "tag: the error's first line",
    TAG_ATTEMPTS: "tag: how many attempts ran",
    TAG_RESTART_STOP: "tag: why the restarts stopped",
    TAG_DIR: "tag: the call's checkpoint location",
    TAG_LATEST: "tag: the latest committed checkpoint (rank 0)",
    TAG_SLOW_RANKS: "tag: the ranks marked slow at the end",
    METRIC_PREFIX + "<step|total_steps|steps_per_second>": "metrics: the last progress values",
    "system/rank_<r>_<" + "|".join(RANK_MEMORY_METRICS) + ">": "system metrics: each rank's "
    "memory while the call runs (with log_system_metrics)",
}

__all__ = [name for name in dir() if name.isupper()]
