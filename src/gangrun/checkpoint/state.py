"""What a `gangrun.Checkpointer` saves of each entry of the user's state mapping.

* a ``torch.nn.Module`` (plain, DDP, FSDP2 ``fully_shard``): its model state dict through
  ``torch.distributed.checkpoint.state_dict`` (sharded tensors stay sharded: each rank writes
  its shards, replicated tensors are written once);
* a ``torch.optim.Optimizer`` over the parameters of one of those modules: its optimizer state
  dict, keyed by parameter name (so it reloads into the same layout, or another sharding);
* a DeepSpeed engine: through the engine's own ``save_checkpoint``/``load_checkpoint`` (it owns
  its ZeRO-partitioned optimizer and scheduler); local directories only;
* a plain ``torch.utils.data.DataLoader``: its position in the pass (`dataloader`), per rank;
* anything else with ``state_dict()``/``load_state_dict()`` (an LR scheduler, a
  `VolumeLoader` / ``VolumeDataset``, a ``GradScaler``...) and every plain
  value (numbers, strings, tensors, lists/dicts of those): per rank, in one blob per rank,
  together with the rank's Python, NumPy and torch (CPU and CUDA) random number generators.

Anything else is refused, naming the key and the rank (`classify`).
"""

from __future__ import annotations

import io
import random
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .dataloader import is_plain_loader, track

_PLAIN = (type(None), bool, int, float, complex, str, bytes)
BLOB = "__gangrun_rank{rank}"  # per-rank entries + RNG states (one bytes item each)


def _is_engine(obj: Any) -> bool:
    return type(obj).__module__.startswith("deepspeed") and hasattr(obj, "save_checkpoint")


def _is_plain(value: Any, depth: int = 0) -> bool:
    if isinstance(value, _PLAIN):
        return True
    if depth > 20:
        return False
    if isinstance(value, (list, tuple, set, frozenset)):
        return all(_is_plain(v, depth + 1) for v in value)
    if isinstance(value, Mapping):
        return all(_is_plain(k, depth + 1) and _is_plain(v, depth + 1) for k, v in value.items())
    mod = type(value).__module__
    return (
        mod.startswith("torch")
        and type(value).__name__ in ("Tensor", "Parameter")
        or (mod.startswith("numpy") and hasattr(value, "dtype"))
    )


@dataclass
class Entries:
    """A state mapping, sorted by how each entry is saved."""

    models: dict[str, Any] = field(default_factory=dict)
    optims: dict[str, tuple[Any, str]] = field(default_factory=dict)  # key -> (optim, model key)
    engines: dict[str, Any] = field(default_factory=dict)
    stateful: dict[str, Any] = field(default_factory=dict)
    plain: dict[str, Any] = field(default_factory=dict)


def classify(state: Mapping[str, Any], rank: int) -> Entries:
    """Sort ``state``'s entries; a ``TypeError`` naming the key and rank for one with no
    state to save."""
    import torch

    if not isinstance(state, Mapping):
        raise TypeError(
            f"Checkpointer on rank {rank}: the state must be a dict of name -> object, got "
            f"{type(state).__name__}."
        )
    out = Entries()
    owners: dict[int, str] = {}
    for key, obj in state.items():
        if not isinstance(key, str) or not key or key.startswith("__gangrun"):
            raise TypeError(f"Checkpointer on rank {rank}: bad state key {key!r} (a name).")
        if _is_engine(obj):
            out.engines[key] = obj
        elif isinstance(obj, torch.nn.Module):
            out.models[key] = obj
            for p in obj.parameters():
                owners.setdefault(id(p), key)
        elif isinstance(obj, torch.optim.Optimizer):
            out.optims[key] = (obj, "")
        elif callable(getattr(obj, "state_dict", None)) and callable(
            getattr(obj, "load_state_dict", None)
        ):
            out.stateful[key] = obj
        elif is_plain_loader(obj):  # its position, recorded from now on (dataloader.py)
            out.stateful[key] = track(obj, key, rank)
        elif _is_plain(obj):
            out.plain[key] = obj
        else:
            raise TypeError(
                f"Checkpointer on rank {rank}: state[{key!r}] is a "
                f"{type(obj).__module__}.{type(obj).__qualname__}, which has no state to save "
                "(no state_dict()/load_state_dict(), and not a plain value: number, string, "
                "tensor, or a list/dict of those). Pass the object whose state it is (the model, "
                "the optimizer, the loader), or its state_dict(), or leave it out."
            )
    for key, (opt, _) in list(out.optims.items()):
        if out.engines and type(opt).__module__.startswith("deepspeed"):
            del out.optims[key]  # the engine saves its own optimizer
            continue
        params = [p for g in opt.param_groups for p in g["params"]]
        model = next((owners[id(p)] for p in params if id(p) in owners), "")
        if model:
            out.optims[key] = (opt, model)
        else:  # not over a module of the state: its own state dict, per rank
            del out.optims[key]
            out.stateful[key] = opt
    return out


def rng_state() -> dict[str, Any]:
    import torch

    st: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if "numpy" in sys.modules:
        st["numpy"] = sys.modules["numpy"].random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: Mapping[str, Any]) -> None:
    import torch

    random.setstate(st["python"])
    torch.set_rng_state(st["torch"])
    if "numpy" in st:
        import numpy

        numpy.random.set_state(st["numpy"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def _model_sd(model: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model)


def _optim_sd(model: Any, opt: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, opt)


def to_bytes(obj: Any) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def from_bytes(raw: bytes) -> Any:
    import torch

    return torch.load(io.BytesIO(raw), weights_only=False, map_location="cpu")


def save_dict(e: Entries, rank: int, extra: dict[str, Any]) -> dict[str, Any]:
    """The ``torch.distributed.checkpoint`` state dict of one save on this rank."""
    sd: dict[str, Any] = {}
    for key, model in e.models.items():
        sd[key] = _model_sd(model)
    for key, (opt, mkey) in e.optims.items():
        sd[key] = _optim_sd(e.models[mkey], opt)
    blob = {
        "rng": rng_state(),
        "stateful": {k: o.state_dict() for k, o in e.stateful.items()},
        "plain": dict(e.plain),
        **extra,
    }
    sd[BLOB.format(rank=rank)] = to_bytes(blob)
    return sd


def load_template(e: Entries, rank: int) -> dict[str, Any]:
    """What to load into: every saved key of this rank, with its current (shape) values."""
    tpl = {k: _model_sd(m) for k, m in e.models.items()}
    tpl.update({k: _optim_sd(e.models[mk], o) for k, (o, mk) in e.optims.items()})
    tpl[BLOB.format(rank=rank)] = b""
    return tpl


def apply(
    e: Entries, tpl: dict[str, Any], rank: int, state: Any, devices: Any = None
) -> dict[str, Any]:
    """Put the loaded values back into the objects (and plain values into ``state`` when it
    is a mutable mapping). Returns this rank's blob (its extra fields)."""
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    for key, model in e.models.items():
        set_model_state_dict(model, tpl[key])
    for key, (opt, mkey) in e.optims.items():
        set_optimizer_state_dict(e.models[mkey], opt, tpl[key])
    raw = tpl[BLOB.format(rank=rank)]
    if not raw:
        raise RuntimeError(f"the checkpoint holds nothing for rank {rank}")
    blob: dict[str, Any] = from_bytes(raw)
    for key, obj in e.stateful.items():
        if key in blob["stateful"]:
            obj.load_state_dict(blob["stateful"][key])
    for key, value in blob["plain"].items():
        # every plain value saved goes back, also one the mapping gained after it was made
        # (``state["best"] = loss`` in the loop); not over an entry that is now an object
        if key in e.plain or (isinstance(state, Mapping) and key not in state):
            e.plain[key] = value
            try:
                state[key] = value
            except TypeError:  # an immutable mapping: Checkpointer.state has the values
                pass
    set_rng_state(blob["rng"])
    return blob


__all__ = ["Entries", "classify", "save_dict", "load_template", "apply", "rng_state"]
