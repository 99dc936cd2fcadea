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

**Another world size.** Each blob records the world size that saved it. A checkpoint saved by
N ranks restores on M (`saved_world`, `reshard_check`): models and optimizers through DCP,
which reshards (each rank reads the parts of the saved tensors its new layout holds); the
per-rank blob by the rule *new rank r takes old rank r mod N's blob*. Every new rank thus gets
a real, consistent state (not a default): the step and pending metrics (the same in every
blob), plain values, stateful entries, RNG states. A `gangrun.data.DistributedSampler`'s
position is global, so it is the same in every blob and the data continues exactly; the RNG
streams of new ranks >= N repeat those of rank r mod N (fewer ranks: ranks >= M's streams are
dropped). A `VolumeDataset`/`TableDataset` (or its loader) position is per rank: on another
world size every rank reads the blobs of all N ranks, and the dataset is given every rank's
position, from which it continues the rest of the epoch on M ranks (`gangrun.data.elastic`). A DeepSpeed engine's ZeRO checkpoint is partitioned per rank: it is
refused before anything is loaded, naming DeepSpeed's universal checkpoint conversion.
"""

from __future__ import annotations

import io
import random
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .dataloader import is_plain_loader, track, world_size

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


def save_dict(e: Entries, rank: int, extra: dict[str, Any], encode: Any = None) -> dict[str, Any]:
    """The ``torch.distributed.checkpoint`` state dict of one save on this rank (``encode``:
    how the per-rank blob is stored, `to_bytes` by default; a memory snapshot keeps it a dict,
    `encoded_blob` turns it into those bytes when it is restored)."""
    sd: dict[str, Any] = {}
    for key, model in e.models.items():
        sd[key] = _model_sd(model)
    for key, (opt, mkey) in e.optims.items():
        sd[key] = _optim_sd(e.models[mkey], opt)
    blob = {
        "rng": rng_state(),
        "stateful": {k: o.state_dict() for k, o in e.stateful.items()},
        "plain": dict(e.plain),
        "world_size": world_size(),
        **extra,
    }
    sd[BLOB.format(rank=rank)] = (encode or to_bytes)(blob)
    return sd


def encoded_blob(sd: dict[str, Any], rank: int) -> dict[str, Any]:
    """``sd`` with this rank's blob stored as `save_dict` stores it by default (bytes)."""
    key = BLOB.format(rank=rank)
    if isinstance(sd.get(key), dict):
        sd[key] = to_bytes(sd[key])
    return sd


def saved_world(url: str, storage_options: Mapping[str, Any] | None = None) -> int:
    """How many ranks saved checkpoint ``url`` (its per-rank blobs, from its metadata)."""
    from .volume import VolumeReader

    reader = VolumeReader(url, **dict(storage_options or {}))
    keys = reader.read_metadata().state_dict_metadata.keys()
    prefix = BLOB.split("{", 1)[0]
    return sum(1 for k in keys if k.startswith(prefix)) or 1


def saved_world_or_none(url: str | None, storage_options: Mapping[str, Any]) -> int | None:
    """`saved_world`, or ``None`` (no checkpoint, or its metadata unreadable: the load that
    follows then fails on every rank alike, not this rank alone)."""
    if not url:
        return None
    try:
        return saved_world(url, storage_options)
    except Exception:
        return None


def blob_key(rank: int, saved: int | None = None) -> str:
    """The blob rank ``rank`` restores: its own, or rank ``rank mod saved``'s on another
    world size (see the module docstring)."""
    return BLOB.format(rank=rank % saved if saved else rank)


def reshard_check(e: Entries, url: str, saved: int, world: int, rank: int) -> None:
    """A ``RuntimeError`` when the state cannot be restored from ``saved`` ranks onto
    ``world`` (a DeepSpeed engine), before anything is loaded."""
    if saved == world or not e.engines:
        return
    key = next(iter(e.engines))
    src = f"{url.rstrip('/')}/deepspeed/{key}/engine"
    raise RuntimeError(
        f"Checkpointer on rank {rank}: the checkpoint {url} was saved by {saved} ranks and this "
        f"call has {world}; state[{key!r}] is a DeepSpeed engine, whose ZeRO checkpoint is "
        f"partitioned over the {saved} ranks that saved it and is not resharded here. Resume "
        f"on {saved} ranks (processes={saved} or gpus={saved}), or convert it with DeepSpeed's "
        f"universal checkpoint tool (python -m deepspeed.checkpoint.ds_to_universal "
        f"--input_folder {src} --output_folder <dir>) and load that with "
        "engine.load_checkpoint(<dir>, ...) and the config's "
        '"checkpoint": {"load_universal": true} in a fresh location. Nothing was loaded.'
    )


def resume_note(e: Entries, step: int, saved: int, world: int) -> str:
    """The line a resume onto another world size prints (rank 0)."""
    from .dataloader import LoaderState, global_sampler

    parts = [f"gangrun: resumed step {step} saved by {saved} ranks onto {world}"]
    what = []
    if e.models:
        what.append("model and optimizer resharded" if e.optims else "model resharded")
    kind = getattr(sys.modules.get("gangrun.data.sampler"), "DistributedSampler", None)
    for obj in e.stateful.values():  # a loader with gangrun's sampler, or the sampler itself
        sampler = global_sampler(obj.loader) if isinstance(obj, LoaderState) else obj
        point = sampler.resume_point if kind and isinstance(sampler, kind) else None
        if point is not None:
            what.append(f"data at global sample {point[1]} of epoch {point[0]}")
            break
        view = getattr(obj, "volume", None)  # a VolumeLoader / TableLoader, or the dataset
        for ds in (obj, view, getattr(view, "ds", None)):
            summary = getattr(ds, "resume_summary", None)
            note = summary() if callable(summary) else None
            if note:
                what.append(note)
                break
    return parts[0] + (": " + ", ".join(what) if what else "")


def _resharded(saved: int | None) -> bool:
    return bool(saved) and saved != world_size()


def load_template(e: Entries, rank: int, saved: int | None = None) -> dict[str, Any]:
    """What to load into: every saved key of this rank (``saved``: the world size that
    saved it, when another: then every rank's blob, for the data positions), with its
    current (shape) values."""
    tpl = {k: _model_sd(m) for k, m in e.models.items()}
    tpl.update({k: _optim_sd(e.models[mk], o) for k, (o, mk) in e.optims.items()})
    tpl[blob_key(rank, saved)] = b""
    if saved and _resharded(saved) and e.stateful:
        for r in range(saved):
            tpl[BLOB.format(rank=r)] = b""
    return tpl


def _with_every_rank(tpl: dict[str, Any], blob: dict[str, Any], saved: int) -> None:
    """Add to each stateful entry of ``blob`` the ``rank<R>`` keys of the other blobs: a
    `VolumeDataset`/`TableDataset` (or its loader) saved by ``saved`` ranks then holds every
    rank's position, and continues the rest of the epoch on this world (`gangrun.data.elastic`)."""
    for r in range(saved):
        raw = tpl.get(BLOB.format(rank=r))
        if not raw:
            continue
        other = from_bytes(raw)["stateful"]
        for key, state in blob["stateful"].items():
            theirs = other.get(key)
            if not (isinstance(state, dict) and isinstance(theirs, dict)):
                continue
            for k, v in theirs.items():
                if isinstance(k, str) and k.startswith("rank") and k[4:].isdigit():
                    state.setdefault(k, v)


def apply(
    e: Entries,
    tpl: dict[str, Any],
    rank: int,
    state: Any,
    devices: Any = None,
    saved: int | None = None,
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
    raw = tpl[blob_key(rank, saved)]
    if not raw:
        raise RuntimeError(f"the checkpoint holds nothing for rank {rank}")
    blob: dict[str, Any] = from_bytes(raw)
    if saved and _resharded(saved):
        _with_every_rank(tpl, blob, saved)
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


__all__ = [
    "Entries",
    "apply",
    "blob_key",
    "classify",
    "encoded_blob",
    "load_template",
    "reshard_check",
    "resume_note",
    "rng_state",
    "save_dict",
    "saved_world",
    "saved_world_or_none",
]
