"""The rank half of the hang verdict: each rank records where it is in ``torch.distributed``.

`install` (every rank, at its start) maps ``collectives.<rank>`` (`gangrun.wire.collectives`)
and wraps the collectives and point-to-point ops of ``torch.distributed`` (and
``init_process_group``'s rendezvous) as soon as ``torch.distributed`` is imported: at once when
it already is (a rank forked from a server that preloaded torch), else by an import hook, so
a function that never uses torch imports nothing. Each call writes one record (op, group and
the group's sequence number, shapes and dtypes, the call site in user code) before the op
and stamps its end after: a few microseconds against the tens of microseconds of the
smallest collective (docs/benchmarks.md).

DDP's and FSDP's collectives run from C++ autograd hooks, which no Python wrapper sees:
``Tensor.backward``, ``torch.autograd.backward`` and ``DistributedDataParallel.forward``
(which rebuilds its buckets with a broadcast) are recorded as regions that may communicate,
so a rank stuck there is placed at the user's ``backward()`` or ``model(x)`` line. Ops with
``async_op=True`` (and ``isend``/``irecv``) are recorded as issued: the wait on their
``Work`` is not seen. A DataLoader worker forked from the rank records nothing.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import inspect
import os
import sys
import sysconfig
import time
from collections.abc import Callable
from typing import Any

from ..wire import collectives as ring_file
from ..wire.collectives import LEFT_AT, OpRecord, Ring

_ring: Ring | None = None
_run_dir, _rank = "", 0
_depth = [0]  # inside a recorded collective: torch's own nested calls are not recorded
_regions = [0]  # inside a region that may communicate (backward(), a DDP forward)


def _never() -> bool:
    return False


# torch.compiler.is_compiling once torch is there: while dynamo traces a function, the
# wrappers step aside, so it still sees (and maps) torch's own collectives
_compiling = _never
_seqs: dict[str, int] = {}
_groups: dict[int, tuple[Any, str]] = {}  # id(group) -> (group, its name)
_internal: dict[Any, bool] = {}  # code object -> in torch, gangrun or the standard library
_shapes: dict[tuple[Any, Any], tuple[str, int]] = {}
_PATCHED = "__gangrun_recorded__"

# name -> (the parameter holding the op's tensor, the one naming the peer rank)
_OPS: dict[str, tuple[str | None, str | None]] = {
    "all_reduce": ("tensor", None),
    "broadcast": ("tensor", None),
    "reduce": ("tensor", None),
    "all_gather": ("tensor", None),
    "all_gather_into_tensor": ("input_tensor", None),
    "reduce_scatter": ("output", None),
    "reduce_scatter_tensor": ("output", None),
    "gather": ("tensor", None),
    "scatter": ("tensor", None),
    "all_to_all": (None, None),
    "all_to_all_single": (None, None),
    "barrier": (None, None),
    "monitored_barrier": (None, None),
    "all_gather_object": (None, None),
    "broadcast_object_list": (None, None),
    "gather_object": (None, None),
    "scatter_object_list": (None, None),
    "send": ("tensor", "dst"),
    "recv": ("tensor", "src"),
    "isend": ("tensor", "dst"),
    "irecv": ("tensor", "src"),
}


def _own_dirs() -> tuple[str, ...]:
    dirs = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    torch_file = getattr(sys.modules.get("torch"), "__file__", None)
    if torch_file:
        dirs.append(os.path.dirname(os.path.abspath(torch_file)))
    dirs.append(sysconfig.get_paths()["stdlib"])
    return tuple(d + os.sep for d in dirs)


_dirs: tuple[str, ...] = ()


def _is_internal(filename: str) -> bool:
    return filename.startswith(_dirs) or filename.startswith("<frozen")


def call_site(depth: int = 2) -> str:
    """``path:line`` of the innermost frame outside torch, gangrun and the standard library."""
    f: Any = sys._getframe(depth)
    while f is not None:
        code = f.f_code
        internal = _internal.get(code)
        if internal is None:
            internal = _internal[code] = _is_internal(code.co_filename)
        if not internal:
            return f"{code.co_filename}:{f.f_lineno}"
        f = f.f_back
    return "?"


def _group_name(group: Any) -> str:
    if group is None:
        return "world"
    known = _groups.get(id(group))
    if known is not None and known[0] is group:
        return known[1]
    try:
        import torch.distributed as dist

        ranks = dist.get_process_group_ranks(group)
        name = "world" if len(ranks) == dist.get_world_size() else ",".join(map(str, ranks))
    except Exception:  # not a group torch knows: recorded under its id
        name = f"pg{id(group):x}"
    _groups[id(group)] = (group, name)
    return name


def _shape(t: Any) -> tuple[str, int]:
    try:
        key = (t.dtype, t.shape)
    except AttributeError:
        return "", -1
    known = _shapes.get(key)
    if known is None:
        dtype = str(t.dtype).removeprefix("torch.")
        known = _shapes[key] = (f"{dtype}[{', '.join(map(str, t.shape))}]", int(t.numel()))
    return known


def _static(
    op: str, group: Any, peer: Any, tensor: Any, site: str, peer_param: str | None
) -> tuple[str, bytes]:
    """(the key of the op's sequence numbers, the slot's static bytes) of one call site."""
    name = _group_name(group)
    shapes, numel = _shape(tensor)
    key = name if peer_param is None else f"{name}:{peer_param}{peer}"
    peer_rank = -1 if peer is None else int(peer)
    return key, ring_file.static_bytes(op, name, peer_rank, numel, shapes, site)


def _wrap(fn: Callable[..., Any], op: str) -> Callable[..., Any]:
    tensor_param, peer_param = _OPS[op]
    params = list(inspect.signature(fn).parameters)
    absent = 1 << 30  # an index no call reaches: the keyword look-up then

    def at(name: str | None) -> int:
        return params.index(name) if name in params else absent

    t_at, g_at, p_at, a_at = at(tensor_param), at("group"), at(peer_param), at("async_op")
    t_kw, p_kw = tensor_param or "", peer_param or ""
    issued_only = peer_param is not None and op.startswith("i")
    # call site (code id, line, group, peer) -> (tensor seen, its numel, dtype, seq key, bytes,
    # code); (code,) alone: the caller is torch's own code, whose user site varies
    statics: dict[tuple[Any, ...], tuple[Any, ...]] = {}

    def site_of(f: Any, t: Any, group: Any, peer: Any) -> tuple[Any, ...]:
        code = f.f_code
        if _is_internal(code.co_filename):
            return ()
        numel, dtype = (-1, None) if t is None else (t.numel(), t.dtype)
        site = f"{code.co_filename}:{f.f_lineno}"
        return (t, numel, dtype, *_static(op, group, peer, t, site, peer_param))

    @functools.wraps(fn)
    def recorded(*args: Any, **kwargs: Any) -> Any:
        ring = _ring
        if ring is None or _depth[0] or _compiling():
            return fn(*args, **kwargs)
        _depth[0] += 1
        off = -1
        try:  # recording must never break the user's call
            n = len(args)
            t = args[t_at] if t_at < n else kwargs.get(t_kw)
            group = args[g_at] if g_at < n else kwargs.get("group")
            peer = None
            if peer_param is not None:
                peer = args[p_at] if p_at < n else kwargs.get(p_kw)
                if peer is None:
                    peer = kwargs.get("group_" + p_kw)
            f = sys._getframe(1)
            code = f.f_code
            key = (id(code), f.f_lineno, group, peer)  # id: hashing a code object is slow
            known = statics.get(key)
            if (
                known is None
                or known[-1] is not code  # another code object at a freed one's address
                or known[0] is not t
                and (t is None or known[1] != t.numel() or known[2] != t.dtype)
            ):
                known = statics[key] = (*site_of(f, t, group, peer), code)
            if len(known) == 1:  # called from torch's own code: the user's line, walked to
                seq_key, static = _static(op, group, peer, t, call_site(2), peer_param)
            else:
                seq_key, static = known[3], known[4]
            seq = _seqs[seq_key] = _seqs.get(seq_key, 0) + 1
            now = time.time()
            off = ring.write(static, seq, now)
            if issued_only or (a_at < n and args[a_at]) or kwargs.get("async_op"):
                ring.leave(off, now)  # issued: its Work's wait is not seen
                off = -1
        except Exception:
            off = -1
        try:
            return fn(*args, **kwargs)
        finally:
            _depth[0] -= 1
            if off >= 0:
                ring.stamp(off + LEFT_AT, time.time())

    setattr(recorded, _PATCHED, True)
    return recorded


def _wrap_region(fn: Callable[..., Any], op: str) -> Callable[..., Any]:
    @functools.wraps(fn)
    def region(*args: Any, **kwargs: Any) -> Any:
        ring = _ring
        if ring is None or _depth[0] or _regions[0] or _compiling():
            return fn(*args, **kwargs)
        off = -1
        try:
            seq = _seqs[op] = _seqs.get(op, 0) + 1
            off = ring.enter(OpRecord(op, "world", seq, -1, -1, "", call_site(), time.time(), 0.0))
        except Exception:  # recording must never break the user's call
            off = -1
        _regions[0] += 1  # a region inside a region (autograd.backward in Tensor.backward) is
        try:  # the same one; collectives inside it are recorded
            return fn(*args, **kwargs)
        finally:
            _regions[0] -= 1
            if off >= 0:
                ring.leave(off, time.time())

    setattr(region, _PATCHED, True)
    return region


def _nccl() -> bool:
    """The default process group uses NCCL (gloo's Flight Recorder dump can block while it
    holds the GIL: it is read on NCCL only)."""
    try:
        import torch.distributed as dist

        return "nccl" in str(dist.get_backend()).lower()
    except Exception:  # no default group
        return False


def _wrap_init(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        ring = _ring
        if ring is None or _depth[0] or _compiling():
            return fn(*args, **kwargs)
        off = -1
        try:
            rec = OpRecord("init_process_group", "world", 0, -1, -1, "", call_site(),
                           time.time(), 0.0)  # fmt: skip
            off = ring.enter(rec)
        except Exception:  # recording must never break the user's call
            off = -1
        _depth[0] += 1
        try:
            out = fn(*args, **kwargs)
        finally:
            _depth[0] -= 1
            _seqs.pop("world", None)
            if off >= 0:
                ring.leave(off, time.time())
        if _run_dir and _nccl():
            from . import flight

            flight.start(_run_dir, _rank)  # torch's Flight Recorder, when it is on
        return out

    setattr(init_process_group, _PATCHED, True)
    return init_process_group


def _tell_dynamo(c10d: Any) -> None:
    """torch.compile maps torch's collectives to traceable ones by identity
    (``traceable_collective_remaps``): the wrappers map as the functions they wrap (once that
    table is made after the patch, it holds the wrappers already)."""
    fc = sys.modules.get("torch.distributed._functional_collectives")
    remaps = getattr(fc, "traceable_collective_remaps", None)
    if not isinstance(remaps, dict) or c10d is None:
        return
    for name in _OPS:
        wrapper = getattr(c10d, name, None)
        original = getattr(wrapper, "__wrapped__", None)
        if original in remaps:
            remaps[wrapper] = remaps[original]


def patch(dist: Any) -> None:
    """Wrap ``torch.distributed``'s ops (module and ``distributed_c10d`` alike), once."""
    global _dirs, _compiling
    _dirs = _own_dirs()
    compiler = getattr(sys.modules.get("torch"), "compiler", None)
    _compiling = getattr(compiler, "is_compiling", None) or _never
    c10d = getattr(dist, "distributed_c10d", None)
    for mod in (c10d, dist):
        if mod is None:
            continue
        for name in (*_OPS, "init_process_group"):
            fn = getattr(mod, name, None)
            if fn is None or getattr(fn, _PATCHED, False):
                continue
            done = getattr(c10d, name, None) if mod is dist else None
            if done is not None and getattr(done, "__wrapped__", None) is fn:
                setattr(dist, name, done)  # the same function: the same wrapper
                continue
            wrapped = _wrap_init(fn) if name == "init_process_group" else _wrap(fn, name)
            setattr(mod, name, wrapped)
    _tell_dynamo(c10d)
    torch = sys.modules.get("torch")
    if torch is None:
        return
    for owner in (getattr(torch, "Tensor", None), getattr(torch, "autograd", None)):
        fn = getattr(owner, "backward", None)
        if owner is not None and fn is not None and not getattr(fn, _PATCHED, False):
            owner.backward = _wrap_region(fn, "backward")
    ddp = sys.modules.get("torch.nn.parallel.distributed")  # imported with torch.nn
    cls = getattr(ddp, "DistributedDataParallel", None)
    fn = getattr(cls, "forward", None)
    if cls is not None and fn is not None and not getattr(fn, _PATCHED, False):
        cls.forward = _wrap_region(fn, "DDP forward")  # it may broadcast (bucket rebuilds)


class _Hook(importlib.abc.MetaPathFinder):
    """Patches ``torch.distributed`` right after it is first imported."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "torch.distributed":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        loader = None if spec is None else spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return None
        run = loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            try:
                patch(module)
            except Exception:  # unrecorded then; the verdict falls back on stacks
                pass

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _forked() -> None:
    global _ring
    _ring = None  # a DataLoader worker (or any fork of the rank) writes nothing


def install(run_dir: str, rank: int) -> None:
    """In a rank: start the ring and record ``torch.distributed`` from now on."""
    global _ring, _run_dir, _rank
    _run_dir, _rank = run_dir, rank
    try:
        _ring = Ring.open(ring_file.path(run_dir, rank), rank)
    except (OSError, ValueError):  # no record then; the verdict falls back on stacks
        return
    os.register_at_fork(after_in_child=_forked)
    dist = sys.modules.get("torch.distributed")
    if dist is not None:
        patch(dist)
    elif not any(isinstance(f, _Hook) for f in sys.meta_path):
        sys.meta_path.insert(0, _Hook())


__all__ = ["call_site", "install", "patch"]
