"""Where a Ray gang's ranks go: the connection, the placement group (one bundle per rank),
the per-node torchrun environment of each rank."""

from __future__ import annotations

import os
from typing import Any

from ...errors import LaunchError
from ...options import RAY_STRATEGIES as STRATEGIES  # noqa: F401 (launch.ray exports it)
from ...wire import contract
from .. import GangSpec, RankSpec, RayPlacement
from .records import NodeInfo

# Per-node variables the actor computes (the caller's values mean nothing on another node).
_NODE_LOCAL = ("CUDA_VISIBLE_DEVICES",)


def ray_module() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise LaunchError(
            "backend='ray' needs Ray: pip install 'gangrun[ray]' (or pip install 'ray[default]')."
        ) from exc
    return ray


def connect(address: str | None) -> Any:
    """``ray.init`` once per caller process (reusing a connection the user already made)."""
    ray = ray_module()
    if ray.is_initialized():
        return ray
    address = address or os.environ.get("RAY_ADDRESS") or None
    kwargs: dict[str, Any] = {
        "ignore_reinit_error": True,
        "log_to_driver": False,  # rank output is forwarded by gangrun itself
        "logging_level": "WARNING",
        "configure_logging": False,
    }
    try:
        if address == "local":
            ray.init(include_dashboard=False, **kwargs)
        else:
            ray.init(address=address or "auto", **kwargs)
    except ConnectionError as exc:
        raise LaunchError(
            f"Could not connect to a Ray cluster ({address or 'no address given, none running'}"
            f"): {str(exc).rstrip('.')}. Pass address='ray://host:10001' or 'host:6379' (or "
            "set RAY_ADDRESS), start one with `ray start --head`, or pass address='local' to "
            "start a Ray on this machine."
        ) from exc
    return ray


def fmt_resources(res: dict[str, float]) -> str:
    keep = {k: v for k, v in res.items() if not k.startswith(("node:", "memory", "object_store"))}
    return ", ".join(f"{k}={v:g}" for k, v in sorted(keep.items())) or "nothing"


def placement_of(spec: GangSpec) -> RayPlacement:
    """``spec.placement`` (set by the lifecycle's Ray planner)."""
    if spec.placement is None:
        raise ValueError("a Ray gang needs spec.placement (gangrun.lifecycle.ray_plan)")
    return spec.placement


def reserve(ray: Any, placement: RayPlacement, n: int) -> Any:
    """A ready placement group of ``n`` bundles, or [`LaunchError`][gangrun.errors.LaunchError] after the timeout."""
    from ray.util.placement_group import placement_group, remove_placement_group

    bundle = placement.bundle
    pg = placement_group([dict(bundle) for _ in range(n)], strategy=placement.strategy)
    wait = placement.placement_timeout
    ready, _ = ray.wait([pg.ready()], timeout=wait)
    if not ready:
        remove_placement_group(pg)
        avail = ray.available_resources()
        raise LaunchError(
            f"Ray could not reserve {n} bundle(s) of {bundle} with strategy "
            f"{placement.strategy} within {wait:g}s (available now: {fmt_resources(avail)}). "
            f"Free resources, ask for fewer ranks, or change {contract.RAY_STRATEGY}."
        )
    return pg


def check_gpu_type(want: str | None, nodes: dict[int, NodeInfo]) -> None:
    if not want:
        return
    from ...host import accelerators

    for r, info in nodes.items():
        for name in info.gpu_names:
            if not accelerators.matches_type(name, want):
                raise LaunchError(
                    f"gpu_type={want!r} does not match the accelerator {name!r} that Ray "
                    f"gave rank {r} on node {info.ip}."
                )


def node_envs(
    ranks: list[RankSpec], nodes: dict[int, NodeInfo], port: int, user_omp: bool
) -> dict[int, dict[str, str]]:
    """Each rank's environment from the bundle -> node mapping: ``NODE_RANK`` (rank 0's node
    is node 0, the others in order of their lowest rank), ``LOCAL_RANK`` within the node,
    ``MASTER_ADDR`` = rank 0's node, ``CUDA_VISIBLE_DEVICES`` = the gang's GPUs on the node
    in local-rank order (so ``cuda:LOCAL_RANK`` is the rank's own GPU)."""
    order: list[str] = []
    local: dict[str, list[int]] = {}
    for rs in sorted(ranks, key=lambda r: r.rank):
        node = nodes[rs.rank].node_id
        if node not in local:
            order.append(node)
            local[node] = []
        local[node].append(rs.rank)
    master = nodes[0].ip
    envs: dict[int, dict[str, str]] = {}
    for rs in ranks:
        r = rs.rank
        info = nodes[r]
        node = info.node_id
        peers = local[node]
        env = {k: v for k, v in rs.env.items() if k not in _NODE_LOCAL}
        env.update(
            {
                "LOCAL_RANK": str(peers.index(r)),
                "LOCAL_WORLD_SIZE": str(len(peers)),
                "NODE_RANK": str(order.index(node)),
                "GROUP_RANK": str(order.index(node)),
                "GROUP_WORLD_SIZE": str(len(order)),
                "MASTER_ADDR": master,
                "MASTER_PORT": str(port),
                contract.RAY_NODE_ID: node,
                contract.RAY_NODE_IP: info.ip,
            }
        )
        if not user_omp:
            env["OMP_NUM_THREADS"] = str(max(1, info.cpus // len(peers)))
        gpus = [g for p in peers for g in nodes[p].gpu_ids]
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        envs[r] = env
    return envs
