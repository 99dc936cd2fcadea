"""The state dict of one save, flattened into a memory snapshot slot and read back bitwise.

The dict is the one a storage checkpoint writes (`gangrun.checkpoint.state.save_dict`: the
models' and optimizers' state dicts, the per-rank blob of stateful entries, plain values and
RNG states). `flatten` replaces every tensor in it by a `TensorRef` and lists the tensors;
the rest (the skeleton, with each tensor's dtype, shape and place in the data) is pickled as
the slot's meta; the tensors' bytes follow, each one copied once, straight from the tensor
(on the CPU or a GPU) into the slot's shared memory (`copy_into`). `unflatten` builds the dict
again with fresh tensors (copied out of the slot: nothing restored aliases the slot, which
the next snapshot overwrites). The slot's layout and checksums: `gangrun.wire.snapshot`.

Only plain tensors are taken: a sharded tensor (FSDP's ``DTensor``, ``ShardedTensor``), a
quantized, sparse or nested one raises `Unsupported` (the call then keeps storage
checkpoints only).
"""

from __future__ import annotations

import pickle
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..wire.snapshot import ALIGN


class Unsupported(TypeError):
    """A state dict a memory snapshot cannot hold (the message says which entry and why)."""


@dataclass(frozen=True)
class TensorRef:
    """Where a tensor of the skeleton went: its index in the meta's tensor table."""

    index: int


@dataclass(frozen=True)
class Flat:
    """A flattened state dict: the pickled skeleton and tensor table (the slot's meta), the
    tensors to copy and where each goes in the data."""

    meta: bytes
    tensors: list[Any]  # contiguous CPU or GPU tensors, in data order
    offsets: list[int]
    data_len: int


def _check(t: Any, where: tuple[Any, ...]) -> None:
    import torch

    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        raise Unsupported(f"{_name(where)} is a {type(t).__name__} (a sharded tensor)")
    if t.layout != torch.strided or t.is_quantized or t.is_nested:
        raise Unsupported(f"{_name(where)} is a {t.layout} tensor")


_DTYPES: dict[Any, str] = {}
_SCALARS = frozenset({int, float, bool, str, bytes, type(None)})


def _dtype(dtype: Any) -> str:
    name = _DTYPES[dtype] = str(dtype).rsplit(".", 1)[-1]
    return name


def _name(where: tuple[Any, ...]) -> str:
    return str(where[0]) + "".join(f"[{k!r}]" for k in where[1:])


def flatten(sd: dict[str, Any]) -> Flat:
    """The skeleton of ``sd`` with its tensors taken out (raises `Unsupported`)."""
    import torch

    tensors: list[Any] = []
    specs: list[tuple[str, tuple[int, ...], int, int]] = []
    offset = 0

    def walk(obj: Any, where: tuple[Any, ...]) -> Any:
        nonlocal offset
        if isinstance(obj, torch.Tensor):
            _check(obj, where)
            t = obj.detach()
            if not t.is_contiguous():
                t = t.contiguous()
            n = t.numel() * t.element_size()
            specs.append((_DTYPES.get(t.dtype) or _dtype(t.dtype), tuple(t.shape), offset, n))
            tensors.append(t)
            offset += (n + ALIGN - 1) // ALIGN * ALIGN
            return TensorRef(len(specs) - 1)
        if len(where) > 50:
            raise Unsupported(f"{_name(where)} is nested too deep")
        kind = type(obj)
        if kind is dict or kind is OrderedDict:
            return kind((k, walk(v, (*where, k))) for k, v in obj.items())
        if kind is list or kind is tuple:
            if all(type(v) in _SCALARS for v in obj):  # e.g. Python's RNG state: as it is
                return obj
            out = [walk(v, (*where, i)) for i, v in enumerate(obj)]
            return out if kind is list else tuple(out)
        return obj

    skeleton = {k: walk(v, (k,)) for k, v in sd.items()}
    meta = pickle.dumps((skeleton, specs), protocol=5)
    return Flat(meta, tensors, [s[2] for s in specs], offset)


def copy_into(flat: Flat, data: Any) -> None:
    """Copy ``flat``'s tensors into ``data`` (a uint8 CPU tensor over the slot's data)."""
    import torch

    for t, off in zip(flat.tensors, flat.offsets, strict=True):
        n = t.numel() * t.element_size()
        if n == 0:
            continue
        src = t.reshape(-1).view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)
        data[off : off + n].copy_(src)


def unflatten(meta: Any, fill: Callable[[Any, int], None], template: Any = None) -> dict[str, Any]:
    """The state dict of a slot (``meta``: its bytes; ``fill(dst, offset)``: copies the data's
    bytes at ``offset`` into ``dst``, a uint8 CPU tensor). A tensor is read into the tensor
    at the same place of ``template`` (the state's own, as a restore from storage reads
    into them) when that one has its dtype and shape and is a contiguous CPU tensor; into a
    fresh tensor otherwise. Nothing restored aliases the slot."""
    import torch

    skeleton, specs = pickle.loads(bytes(meta))

    def tensor(index: int, like: Any) -> Any:
        dtype_name, shape, off, n = specs[index]
        dtype = getattr(torch, dtype_name)
        fits = (
            type(like) in (torch.Tensor, torch.nn.Parameter)
            and like.dtype == dtype
            and tuple(like.shape) == tuple(shape)
            and like.device.type == "cpu"
            and like.is_contiguous()
        )
        t = like.detach() if fits else torch.empty(shape, dtype=dtype)
        if n:
            fill(t.reshape(-1).view(torch.uint8), off)
        return t

    def build(obj: Any, like: Any) -> Any:
        if isinstance(obj, TensorRef):
            return tensor(obj.index, like)
        kind = type(obj)
        if kind is dict or kind is OrderedDict:
            sub = like if isinstance(like, dict) else {}
            return kind((k, build(v, sub.get(k))) for k, v in obj.items())
        if kind is list or kind is tuple:
            seq = like if isinstance(like, (list, tuple)) and len(like) == len(obj) else ()
            out = [build(v, seq[i] if seq else None) for i, v in enumerate(obj)]
            return out if kind is list else tuple(out)
        return obj

    result: dict[str, Any] = build(skeleton, template or {})
    return result


def check_meta(meta: Any) -> None:
    """Raises what unpickling the meta raises (a slot whose table of contents cannot be
    read is not restored)."""
    pickle.loads(bytes(meta))


__all__ = ["Flat", "TensorRef", "Unsupported", "check_meta", "copy_into", "flatten", "unflatten"]
