"""Transitional: ``RayRun``, the Ray call's *planning* (world size, bundle, strategy, runtime
env, environment filtering), moved here unchanged from ``launch/ray.py``. The lifecycle's plan
replaces it (producing a :class:`~gangrun.launch.RayPlacement`); the lead deletes this module
at merge. It is the only module of ``gangrun.launch`` that imports ``gangrun.run``.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ...errors import LaunchError
from ...run import Run
from .. import GangSpec
from . import RayGang
from .placement import STRATEGIES as _STRATEGIES
from .placement import connect
from .placement import fmt_resources as _fmt_resources

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
    "GANGRUN_",
    "PYTHONHASHSEED",
    "PYTHONFAULTHANDLER",
    "DS_",
)


def _knob(opts: Any, name: str, default: str | None = None) -> str | None:
    env = opts.env or {}
    if name in env:
        return str(env[name])
    return os.environ.get(name, default)


# ---------------------------------------------------------------------------------- run
class RayRun(Run):
    """A :class:`~gangrun.run.Run` whose ranks live on a Ray cluster."""

    def _resolve_world(self) -> None:
        o = self.opts
        ray = connect(o.address)
        total = ray.cluster_resources()
        if o.processes is not None:
            self.world_size = o.processes
            have = total.get("CPU", 0)
            kind = "CPU"
        else:
            have = total.get("GPU", 0)
            if o.gpus is None and have < 1:
                raise LaunchError(
                    "The Ray cluster has no GPU (resources: "
                    f"{_fmt_resources(total)}). To run CPU ranks (gloo) instead, pass "
                    "processes=N, e.g. @distributed(processes=2, backend='ray')."
                )
            self.world_size = o.gpus if o.gpus is not None else int(have)
            kind = "GPU"
        if self.world_size > have:
            raise LaunchError(
                f"{'processes' if kind == 'CPU' else 'gpus'}={self.world_size} but the Ray "
                f"cluster has {have:g} {kind}(s) in all ({_fmt_resources(total)}). Ask for at "
                "most that many ranks, or add nodes to the cluster."
            )
        self._bundle = {kind: 1.0}
        if o.gpu_type is not None and kind == "GPU":
            types = [k.split(":", 1)[1] for k in total if k.startswith("accelerator_type:")]
            match = [t for t in types if _type_matches(t, o.gpu_type)]
            if types and not match:
                raise LaunchError(
                    f"gpu_type={o.gpu_type!r} matches none of the Ray cluster's accelerator "
                    f"types ({', '.join(sorted(types))})."
                )
            if match:
                self._bundle[f"accelerator_type:{match[0]}"] = 0.001
                self.gpu_name = match[0]
            else:
                self.gpu_name = o.gpu_type
        elif kind == "GPU":
            types = [k.split(":", 1)[1] for k in total if k.startswith("accelerator_type:")]
            self.gpu_name = types[0] if len(types) == 1 else None
        strategy = (_knob(o, "GANGRUN_RAY_STRATEGY", "PACK") or "PACK").upper()
        if strategy not in _STRATEGIES:
            raise LaunchError(
                f"GANGRUN_RAY_STRATEGY must be one of {_STRATEGIES}, got {strategy!r}."
            )
        self._strategy = strategy
        raw = _knob(o, "GANGRUN_RAY_RUNTIME_ENV")
        try:
            self._runtime_env = json.loads(raw) if raw else {}
        except ValueError as exc:
            raise LaunchError(f"GANGRUN_RAY_RUNTIME_ENV is not valid JSON: {exc}") from exc
        if not isinstance(self._runtime_env, dict):
            raise LaunchError("GANGRUN_RAY_RUNTIME_ENV must be a JSON object.")
        self._runtime_env = _upload_local_dirs(ray, self._runtime_env)
        self._placement_timeout = float(_knob(o, "GANGRUN_RAY_PLACEMENT_TIMEOUT", "300") or 300)
        if o.timeout is not None:
            self._placement_timeout = min(self._placement_timeout, float(o.timeout))

    def _gang_spec(self) -> GangSpec:
        spec = super()._gang_spec()
        caller = os.environ
        user = {str(k): str(v) for k, v in (self.opts.env or {}).items()}
        tracked = self.tracker.rank_env() if self.tracker is not None else {}
        extra_names = {
            s.strip() for s in (_knob(self.opts, "GANGRUN_RAY_FORWARD_ENV") or "").split(",")
        }
        for rs in spec.ranks:
            base = rs.env
            rs.env = {
                k: v
                for k, v in base.items()
                if k in user
                or k in tracked
                or k in extra_names
                or caller.get(k) != v
                or k.startswith(_FORWARD_PREFIXES)
            }
            for k in ("RANK", "WORLD_SIZE", "PYTHONUNBUFFERED", "TORCH_NCCL_ASYNC_ERROR_HANDLING"):
                rs.env[k] = base[k]
        spec.extra.update(
            {
                "bundle": self._bundle,
                "strategy": self._strategy,
                "runtime_env": self._runtime_env,
                "placement_timeout": self._placement_timeout,
                "gpu_type": self.opts.gpu_type if "GPU" in self._bundle else None,
                "user_omp": "OMP_NUM_THREADS" in user or "OMP_NUM_THREADS" in caller,
            }
        )
        return spec

    def _launcher(self) -> Any:
        return RayGang

    def tracking_info(self) -> dict[str, Any]:
        info = super().tracking_info()
        info["backend"] = "ray"
        return info


def _upload_local_dirs(ray: Any, runtime_env: dict[str, Any]) -> dict[str, Any]:
    """Upload a local ``working_dir``/``py_modules`` to the cluster (as ``ray.init`` does for
    a job's runtime env; Ray refuses local paths in an actor's own runtime env)."""
    wd = runtime_env.get("working_dir")
    mods = runtime_env.get("py_modules") or []
    local = (isinstance(wd, str) and "://" not in wd) or any(
        not isinstance(m, str) or "://" not in m for m in mods
    )
    if not local:
        return runtime_env
    try:
        from ray._private.runtime_env.py_modules import upload_py_modules_if_needed
        from ray._private.runtime_env.working_dir import upload_working_dir_if_needed

        scratch = ray._private.worker.global_worker.node.get_runtime_env_dir_path()
        env = dict(runtime_env)
        env = upload_py_modules_if_needed(env, include_gitignore=True, scratch_dir=scratch)
        env = upload_working_dir_if_needed(env, include_gitignore=True, scratch_dir=scratch)
        env.pop("excludes", None)
        return env  # type: ignore[no-any-return]
    except Exception as exc:
        raise LaunchError(
            f"Could not upload the local working_dir/py_modules of GANGRUN_RAY_RUNTIME_ENV "
            f"({exc}). Pass them to ray.init(runtime_env=...) yourself before the call, or "
            "give URIs (s3://..., gs://...) instead."
        ) from exc


def _type_matches(ray_type: str, want: str) -> bool:
    from ... import accelerators

    # Ray's names look like "H100", "A10G", "NVIDIA_H100-80GB"...
    return accelerators.matches_type(ray_type.replace("_", " "), want)
