"""The Ray backend's planner: world size, placement and rank environments on a Ray cluster.

The second planner beside `gangrun.lifecycle.plan.plan_local`. It connects to the
cluster (``address=`` / ``RAY_ADDRESS``) to read its resources, sizes the world, and decides
the `gangrun.launch.RayPlacement` the Ray launcher uses. Its settings are the fields of
``opts.ray`` (`gangrun.RayOptions`: ``strategy``, ``runtime_env``, ``placement_timeout``,
``forward_env``), resolved once with the call's options (their variables, e.g.
``GANGRUN_RAY_STRATEGY``, are read there: `gangrun.defaults`).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping, Set
from typing import TYPE_CHECKING, Any

from ..errors import LaunchError
from ..launch import GangSpec, RayPlacement
from ..launch.ray.placement import connect, fmt_resources
from ..launch.ray.ship import upload_runtime_env
from ..options import Options, setting
from ..wire import contract
from .plan import Plan

if TYPE_CHECKING:
    from .record import CallRecord

# Caller variables shipped to remote ranks even though gangrun did not set them; the rest of
# the caller's environment (PATH, HOME, virtualenv...) belongs to the caller's machine.
_FORWARD_PREFIXES = (
    "MLFLOW_",
    "HF_",
    "HUGGINGFACE_",
    "TRANSFORMERS_",
    "TOKENIZERS_",
    "WANDB_",
    "NCCL_",
    "GLOO_",
    "TORCH_",
    "PYTORCH_",
    "CUDA_LAUNCH_BLOCKING",
    "OMP_",
    "MKL_",
    "AWS_",
    "FSSPEC_",
    contract.PREFIX,
    "PYTHONHASHSEED",
    "PYTHONFAULTHANDLER",
    "DS_",
)


def _type_matches(ray_type: str, want: str) -> bool:
    from ..host import accelerators

    # Ray's names look like "H100", "A10G", "NVIDIA_H100-80GB"...
    return accelerators.matches_type(ray_type.replace("_", " "), want)


def plan_ray(fn: Callable[..., Any], opts: Options) -> tuple[Plan, RayPlacement]:
    """Size the world on the cluster and decide the placement (raises ``LaunchError``)."""
    plan = Plan(0, backend="ray")
    ray = connect(opts.address)
    total = ray.cluster_resources()
    if opts.processes is not None:
        plan.world_size = opts.processes
        have = total.get("CPU", 0)
        kind = "CPU"
    else:
        have = total.get("GPU", 0)
        if isinstance(opts.gpus, list):
            raise LaunchError(
                f"gpus={opts.gpus!r} names device indices of this node; with backend='ray' "
                "give a count (gpus=N): Ray picks the GPUs on each node."
            )
        if opts.gpus is None and have < 1:
            raise LaunchError(
                "The Ray cluster has no GPU (resources: "
                f"{fmt_resources(total)}). To run CPU ranks (gloo) instead, pass "
                "processes=N, e.g. @distributed(processes=2, backend='ray')."
            )
        plan.world_size = opts.gpus if opts.gpus is not None else int(have)
        kind = "GPU"
    if opts.min_ranks is not None and opts.max_restarts < 1:
        raise LaunchError(
            f"min_ranks={opts.min_ranks} applies to restarts, and max_restarts is 0: pass "
            "max_restarts=N (N >= 1) too, or leave min_ranks out."
        )
    if opts.min_ranks is not None and opts.min_ranks > plan.world_size:
        raise LaunchError(
            f"min_ranks={opts.min_ranks} is more than the call's {plan.world_size} ranks: "
            f"give min_ranks <= {plan.world_size}."
        )
    if plan.world_size > have:
        raise LaunchError(
            f"{'processes' if kind == 'CPU' else 'gpus'}={plan.world_size} but the Ray "
            f"cluster has {have:g} {kind}(s) in all ({fmt_resources(total)}). Ask for at "
            "most that many ranks, or add nodes to the cluster."
        )
    bundle = {kind: 1.0}
    types = [k.split(":", 1)[1] for k in total if k.startswith("accelerator_type:")]
    if opts.gpu_type is not None and kind == "GPU":
        match = [t for t in types if _type_matches(t, opts.gpu_type)]
        if types and not match:
            raise LaunchError(
                f"gpu_type={opts.gpu_type!r} matches none of the Ray cluster's accelerator "
                f"types ({', '.join(sorted(types))})."
            )
        if match:
            bundle[f"accelerator_type:{match[0]}"] = 0.001
        plan.gpu_name = match[0] if match else opts.gpu_type
    elif kind == "GPU":
        plan.gpu_name = types[0] if len(types) == 1 else None
    settings = opts.ray.with_builtins()
    runtime_env = upload_runtime_env(runtime_env_of(opts))
    timeout = float(setting(settings, "placement_timeout"))
    if opts.timeout is not None:
        timeout = min(timeout, float(opts.timeout))
    user = {str(k): str(v) for k, v in (opts.env or {}).items()}
    placement = RayPlacement(
        bundle=bundle,
        strategy=settings.strategy or "PACK",
        runtime_env=runtime_env,
        placement_timeout=timeout,
        gpu_type=opts.gpu_type if kind == "GPU" else None,
        user_omp="OMP_NUM_THREADS" in user or "OMP_NUM_THREADS" in os.environ,
        shipping=opts.ray,
    )
    return plan, placement


def resize(call: CallRecord, lost: Set[str], wait_s: float = 60.0) -> CallRecord:
    """The record of a ``min_ranks`` call's next attempt: as many ranks as it asked for when
    the cluster can place them now, else as many as it can (at least ``min_ranks``: the
    placement then waits for them). The nodes of the ranks lost in the last attempt
    (``lost``) are first waited for, ``wait_s`` at most, until Ray has them dead (its health checks take
    seconds), so their resources are not counted."""
    opts, placement = call.options, call.placement
    assert placement is not None and opts.min_ranks is not None
    ray = connect(opts.address)
    kind = "GPU" if "GPU" in placement.bundle else "CPU"
    lost = set(lost)
    deadline = time.monotonic() + wait_s
    while lost and time.monotonic() < deadline:
        if not lost & {n["NodeID"] for n in ray.nodes() if n.get("Alive")}:
            break
        time.sleep(0.25)
    if opts.processes is not None:
        want = opts.processes
    elif isinstance(opts.gpus, int):
        want = opts.gpus
    else:
        want = int(ray.cluster_resources().get(kind, 0)) or call.world_size
    have, still = -1, 0  # the last gang's bundles come back as its placement group goes
    while time.monotonic() < deadline and still < 4:
        now = int(ray.available_resources().get(kind, 0) + 1e-9)
        if now >= want:
            have = now
            break
        still = still + 1 if now == have else 0
        have = now
        time.sleep(0.25)
    world = max(opts.min_ranks, min(want, have))
    if world != call.world_size:
        print(
            f"gangrun: restarting {call.fn_name} on {world} ranks (the cluster can place {have} "
            f"{kind} bundle(s) of the {want} asked; min_ranks={opts.min_ranks})",
            file=call.stderr,
            flush=True,
        )
        return dataclasses.replace(call, plan=dataclasses.replace(call.plan, world_size=world))
    return call


def runtime_env_of(opts: Options) -> dict[str, Any]:
    """The rank actors' Ray runtime env: ``RayOptions.runtime_env`` (default
    ``GANGRUN_RAY_RUNTIME_ENV``), with ``RayOptions.pip`` and ``env_vars`` merged in."""
    ro = opts.ray
    runtime_env = dict(ro.runtime_env or {})
    if ro.pip:
        have = runtime_env.get("pip") or []
        if not isinstance(have, list):
            raise LaunchError(
                "RayOptions(pip=...) adds to a runtime env 'pip' list; the runtime env gives "
                f"{have!r}: put the packages in one place."
            )
        runtime_env["pip"] = [*have, *ro.pip]
    if ro.env_vars:
        runtime_env["env_vars"] = {**(runtime_env.get("env_vars") or {}), **ro.env_vars}
    mods = runtime_env.get("py_modules")
    if mods:
        runtime_env["py_modules"] = [_module_path(m) for m in mods]
    return runtime_env


def _module_path(entry: Any) -> Any:
    """A ``py_modules`` entry that names a module (``"mylib"`` for ``mylib.py`` beside the
    caller) as the file or package directory Ray can upload."""
    if not isinstance(entry, str) or "://" in entry or os.path.exists(entry):
        return entry
    if os.path.isfile(entry + ".py"):
        return os.path.abspath(entry + ".py")
    import importlib.util

    try:
        spec = importlib.util.find_spec(entry)
    except (ImportError, ValueError):
        return entry
    if spec is not None and spec.submodule_search_locations:
        return next(iter(spec.submodule_search_locations), entry)
    if spec is not None and spec.origin and os.path.isfile(spec.origin):
        return spec.origin
    return entry


def ship_env(
    spec: GangSpec, opts: Options, placement: RayPlacement, tracked: Mapping[str, str]
) -> None:
    """Keep in each rank's environment only what a remote node needs: what gangrun or the
    user set, MLflow's variables, the forwarded prefixes (the caller's PATH, HOME, virtualenv
    belong to the caller's machine); and set the placement on the spec."""
    caller = os.environ
    user = {str(k): str(v) for k, v in (opts.env or {}).items()}
    names = set(opts.ray.with_builtins().forward_env or ())
    for rs in spec.ranks:
        base = rs.env
        rs.env = {
            k: v
            for k, v in base.items()
            if k in user
            or k in tracked
            or k in names
            or caller.get(k) != v
            or k.startswith(_FORWARD_PREFIXES)
        }
        for k in ("RANK", "WORLD_SIZE", "PYTHONUNBUFFERED", "TORCH_NCCL_ASYNC_ERROR_HANDLING"):
            rs.env[k] = base[k]
    spec.placement = placement


__all__ = ["plan_ray", "resize", "ship_env", "runtime_env_of"]
