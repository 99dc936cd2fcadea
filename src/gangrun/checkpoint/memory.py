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


def unflatten(meta: Any, data: Any) -> dict[str, Any]:
    """The state dict of a slot (``meta``: its bytes; ``data``: a uint8 CPU tensor over its
    data), every tensor a fresh copy."""
    import torch

    skeleton, specs = pickle.loads(bytes(meta))
    out_tensors = []
    for dtype_name, shape, off, n in specs:
        t = torch.empty(shape, dtype=getattr(torch, dtype_name))
        if n:
            t.reshape(-1).view(torch.uint8).copy_(data[off : off + n])
        out_tensors.append(t)

    def build(obj: Any) -> Any:
        if isinstance(obj, TensorRef):
            return out_tensors[obj.index]
        if type(obj) is dict or type(obj) is OrderedDict:
            return type(obj)((k, build(v)) for k, v in obj.items())
        if type(obj) is list:
            return [build(v) for v in obj]
        if type(obj) is tuple:
            return tuple(build(v) for v in obj)
        return obj

    result: dict[str, Any] = build(skeleton)
    return result


__all__ = ["Flat", "TensorRef", "Unsupported", "copy_into", "flatten", "unflatten"]
