"""The plan of a call: world size, devices and every rank's environment.

Side-effect free: it reads the options, the attached accelerators, the caller's environment,
``sys.path`` and working directory, and decides; it acquires nothing (GPU *reservation* is
the supervisor's, see `gangrun.lifecycle.supervisor`). ``gangrun info`` uses only this.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import LaunchError
from ..host.accelerators import Accelerator
from ..host.system import cpu_count, free_port, process_identity
from ..launch import RankSpec
from ..options import Options
from ..wire import contract
from ..wire.records import RankContext, pid_namespace


@dataclass
class Plan:
    """How many ranks, on which devices (the call's identity is its `CallRecord`'s)."""

    world_size: int
    # local GPU ranks: how many of ``devices`` the supervisor reserves (a count), or exactly
    # which (device indices, ``gpus=[0, 3]``); 0: no GPU
    gpus_wanted: int | list[int] = 0
    devices: list[Accelerator] = field(
        default_factory=list
    )  # the candidates (the node's, or those named)
    gpu_name: str | None = None
    context: RankContext | None = None
    backend: str = "local"


def function_name(fn: Callable[..., Any]) -> str:
    return str(getattr(fn, "__qualname__", getattr(fn, "__name__", repr(fn))))


def check_gpu_type(pool: Sequence[Accelerator], gpu_type: str | None) -> None:
    if gpu_type is None:
        return
    from ..host import accelerators

    if not pool:
        raise LaunchError(
            f"gpu_type={gpu_type!r} was requested but no GPU is attached to this node."
        )
    bad = [d for d in pool if not accelerators.matches_type(d.name, gpu_type)]
    if bad:
        raise LaunchError(
            f"gpu_type={gpu_type!r} does not match the attached accelerator "
            f"{bad[0].name!r} (GPU {bad[0].index}). Drop gpu_type to accept it, or run "
            "on a node with the requested GPU."
        )


def plan_local(fn: Callable[..., Any], opts: Options) -> Plan:
    """World size and candidate devices on this node (raises ``LaunchError``)."""
    if opts.min_ranks is not None:
        raise LaunchError(
            f"min_ranks={opts.min_ranks} restarts a Ray call on fewer ranks after a lost node; "
            "this call runs on this node (backend='local'). Pass backend='ray', or leave "
            "min_ranks out."
        )
    plan = Plan(0)
    if opts.processes is not None and opts.gpu_type is None:
        plan.world_size = opts.processes
        return plan
    from ..host import accelerators

    devs = accelerators.detect()
    if opts.processes is not None:  # gpu_type given in CPU mode: still check what is attached
        plan.world_size = opts.processes
        check_gpu_type(devs, opts.gpu_type)
        return plan
    if not devs:
        raise LaunchError(
            "No GPU was found on this node (checked NVML, nvidia-smi and torch). "
            "To run on CPU processes instead (gloo), pass processes=N, e.g. "
            "@distributed(processes=2)."
        )
    want: int | list[int] = opts.gpus if opts.gpus is not None else len(devs)
    pool = accelerators.select_devices(devs, want)
    n = want if isinstance(want, int) else len(pool)
    check_gpu_type(pool[:n], opts.gpu_type)  # the reserved ones are checked again
    plan.world_size = n
    plan.gpus_wanted = want
    plan.devices = pool
    plan.gpu_name = pool[0].name
    return plan


def rank_context(opts: Options) -> RankContext:
    """What every rank adopts from the caller: ``sys.path`` (plus what ``env``'s PYTHONPATH
    adds, first, as Python would put it), working directory, ``argv[0]``, caller identity."""
    try:
        cwd = os.getcwd()
    except FileNotFoundError:
        raise LaunchError(
            "The working directory of this process is gone (it was deleted): the ranks would "
            "start in it. os.chdir() to an existing directory and call again."
        ) from None
    added: list[str] = []
    raw = (opts.env or {}).get("PYTHONPATH")
    if raw:
        added = [os.path.join(cwd, p) for p in str(raw).split(os.pathsep) if p]
    caller_path = [os.fspath(p) for p in sys.path]  # a pathlib.Path is a valid entry too
    paths = added + [p for p in caller_path if p not in added]
    return RankContext(
        sys_path=paths,
        cwd=cwd,
        argv=[os.fspath(a) for a in sys.argv[:1]],
        caller=process_identity(os.getpid()),
        host=socket.gethostname(),
        pid_ns=pid_namespace(),
    )


def base_env(opts: Options, world_size: int, devices: Sequence[Accelerator]) -> dict[str, str]:
    env = dict(os.environ)
    env.update({str(k): str(v) for k, v in (opts.env or {}).items()})
    if "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, cpu_count() // max(1, world_size)))
    if devices:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d.index) for d in devices)
        if not ({"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"} & set(env)):
            env["TORCH_FR_BUFFER_SIZE"] = "2000"  # NCCL's Flight Recorder: the hang verdict
    if opts.backend == "local":
        # one node: gloo's pairs listen on loopback only (docs/security.md)
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if opts.hang_timeout is not None:
        env[contract.HANG_TIMEOUT] = str(opts.hang_timeout)
    return env


def rank_specs(
    plan: Plan,
    opts: Options,
    *,
    run_dir: str,
    run_id: str = "<run id>",
    devices: Sequence[Accelerator] = (),
    attempt: int = 0,
    tracking_env: Mapping[str, str] | None = None,
) -> list[RankSpec]:
    """Every rank's torchrun-compatible environment for one attempt."""
    base = base_env(opts, plan.world_size, devices)
    base.update(tracking_env or {})
    port = free_port()
    n = plan.world_size
    ranks = []
    for r in range(n):
        env = dict(base)
        env.update(
            {
                "RANK": str(r),
                "LOCAL_RANK": str(r),
                "WORLD_SIZE": str(n),
                "LOCAL_WORLD_SIZE": str(n),
                "NODE_RANK": "0",
                "GROUP_RANK": "0",
                "GROUP_WORLD_SIZE": "1",
                "ROLE_NAME": "default",
                "ROLE_RANK": str(r),
                "ROLE_WORLD_SIZE": str(n),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "TORCHELASTIC_RUN_ID": run_id,
                "TORCHELASTIC_RESTART_COUNT": str(attempt),
                "TORCHELASTIC_MAX_RESTARTS": str(opts.max_restarts),
                "PYTHONUNBUFFERED": "1",
                "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
                contract.RUN_ID: run_id,
                contract.RUN_DIR: run_dir,
                contract.CALLER_PID: str(os.getpid()),
            }
        )
        ranks.append(RankSpec(r, env))
    return ranks


__all__ = [
    "Plan",
    "plan_local",
    "rank_context",
    "rank_specs",
    "base_env",
    "check_gpu_type",
]
