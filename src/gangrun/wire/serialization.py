"""The serialization boundary between the caller and the ranks.

The payload (function, args, kwargs) is pickled once with cloudpickle straight into the run
directory; code defined in ``__main__`` (a notebook or a script) travels by value. Before
launch we check that it serializes at all and that it is under the size limit, and when it is
not, we name the offending or the largest captured objects.
"""

from __future__ import annotations

import inspect
import io
import mmap
import os
import pickle
import struct
import sys
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

from .errors import LaunchError

PROTOCOL = 5
DEFAULT_MAX_CAPTURE_BYTES = 1 << 30


class _TooLarge(Exception):
    pass


class _WriteFailed(Exception):
    """Writing the pickled bytes to the file failed (its disk, not the object)."""

    def __init__(self, exc: OSError) -> None:
        super().__init__(str(exc))
        self.exc = exc


class _CountingWriter(io.RawIOBase):
    """A file-like sink that counts bytes, forwards them, and stops past ``limit``."""

    def __init__(self, inner: BinaryIO | None, limit: int | None) -> None:
        self.inner = inner
        self.limit = limit
        self.count = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        n = len(memoryview(b).cast("B"))
        self.count += n
        if self.limit is not None and self.count > self.limit:
            raise _TooLarge
        if self.inner is not None:
            try:
                self.inner.write(b)
            except OSError as exc:
                raise _WriteFailed(exc) from exc
        return n


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def _cloudpickle() -> Any:
    import cloudpickle

    return cloudpickle


def dump(obj: Any, f: BinaryIO) -> None:
    _cloudpickle().dump(obj, f, protocol=PROTOCOL)


def dumps(obj: Any) -> bytes:
    return _cloudpickle().dumps(obj, protocol=PROTOCOL)


def load(f: BinaryIO) -> Any:
    return pickle.load(f)


def _size(obj: Any, limit: int | None) -> int | None:
    """Serialized size of ``obj``; ``None`` if it cannot be serialized."""
    w = _CountingWriter(None, limit)
    try:
        _cloudpickle().dump(obj, w, protocol=PROTOCOL)
    except _TooLarge:
        return w.count
    except Exception:
        return None
    return w.count


def _describe(obj: Any) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}" if t.__module__ != "builtins" else t.__qualname__


def _captured(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Iterator[tuple[str, Any]]:
    """Everything the payload carries, named for error messages."""
    for i, a in enumerate(args):
        yield f"positional argument {i}", a
    for k, v in kwargs.items():
        yield f"argument {k!r}", v
    target = inspect.unwrap(fn)
    try:
        cv = inspect.getclosurevars(target)
    except Exception:
        return
    for k, v in cv.nonlocals.items():
        yield f"closure variable {k!r} of {getattr(target, '__qualname__', target)!r}", v
    for k, v in cv.globals.items():
        if inspect.ismodule(v):
            continue
        yield f"global {k!r} used by {getattr(target, '__qualname__', target)!r}", v


def write_payload(
    path: str,
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    max_bytes: int | None = DEFAULT_MAX_CAPTURE_BYTES,
) -> int:
    """Pickle ``(fn, args, kwargs)`` to ``path`` (mode 0600). Returns its size.

    Raises [`LaunchError`][gangrun.errors.LaunchError] naming the object that cannot be serialized, or the largest
    captured objects when the payload is over ``max_bytes``.
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as raw:
            sink = _CountingWriter(raw, max_bytes)
            buffered = io.BufferedWriter(sink, buffer_size=1 << 20)
            try:
                _cloudpickle().dump((fn, args, kwargs), buffered, protocol=PROTOCOL)
                buffered.flush()
            except _TooLarge:
                raise too_large_error(fn, args, kwargs, max_bytes or 0) from None
            except (LaunchError, _WriteFailed):
                raise
            except Exception as exc:
                raise unpicklable_error(fn, args, kwargs, exc) from exc
            finally:
                try:
                    buffered.detach()
                except Exception:
                    pass  # the size probe is done; a writer that will not detach holds nothing
    except _WriteFailed as failed:
        raise _not_written(path, failed.exc) from failed.exc
    except OSError as exc:  # opening it, or the last bytes flushed at close
        raise _not_written(path, exc) from exc
    return sink.count


def _not_written(path: str, exc: OSError) -> LaunchError:
    from . import diskfull

    if diskfull.is_full(exc):
        return LaunchError("gangrun " + diskfull.full_message("the call's payload", path, exc))
    return LaunchError(f"gangrun could not write the call's payload to {path}: {exc}")


def unpicklable_error(
    fn: Callable[..., Any], args: tuple, kwargs: dict, exc: Exception
) -> LaunchError:
    culprit = None
    for name, obj in _captured(fn, args, kwargs):
        if _size(obj, 1 << 16) is None:
            culprit = (name, obj)
            break
    if culprit is None and _size(fn, 1 << 16) is None:
        culprit = (f"function {getattr(fn, '__qualname__', fn)!r}", fn)
    what = (
        f"{culprit[0]} (a {_describe(culprit[1])})" if culprit else "the function or its arguments"
    )
    return LaunchError(
        f"Cannot send {what} to the ranks: {type(exc).__name__}: {exc}. "
        "Every rank runs in its own process, so the function, its arguments and the globals it "
        "uses must be picklable (cloudpickle). Create such objects (locks, open files, "
        "connections, CUDA tensors from another process...) inside the function instead."
    )


def too_large_error(fn: Callable[..., Any], args: tuple, kwargs: dict, limit: int) -> LaunchError:
    sizes = []
    for name, obj in _captured(fn, args, kwargs):
        n = _size(obj, limit * 2)
        if n is not None:
            sizes.append((n, name, _describe(obj)))
    sizes.sort(reverse=True)
    top = ", ".join(f"{name} ({desc}, {human_bytes(n)})" for n, name, desc in sizes[:3])
    return LaunchError(
        f"The function and its arguments serialize to more than {human_bytes(limit)} "
        f"(max_capture_bytes). Largest captured objects: {top or 'unknown'}. "
        "Load data inside the function (pass a path or URL as the argument, e.g. with "
        "gangrun.data.VolumeDataset) instead of capturing it, or raise max_capture_bytes."
    )


# -- results: pickle protocol 5 with large buffers out of band ------------------------------
#
# A rank's return value is written as: MAGIC, the pickle stream's length and the stream, then
# each out-of-band buffer (length + raw bytes). Large CPU tensors and numpy arrays travel as
# such buffers: written straight from their memory, each page-aligned, and mapped back
# (private, copy-on-write) by the caller: the caller's tensor uses the file's pages directly. torch's own pickling of a tensor would go through an
# in-memory ``torch.save`` and copy the data several times on each side.

MAGIC = b"GANGRUN-OOB1\n"
_OOB_MIN_BYTES = 1 << 16
_LEN = struct.Struct("<Q")
_PAGE = mmap.ALLOCATIONGRANULARITY


def _rebuild_tensor(data: Any, dtype: str, shape: tuple, requires_grad: bool) -> Any:
    import torch

    flat = torch.from_numpy(data) if not isinstance(data, torch.Tensor) else data
    t = flat.view(getattr(torch, dtype)).reshape(shape)
    if requires_grad:
        t.requires_grad_(True)
    return t


def _tensor_reducer(obj: Any) -> Any:
    """Out-of-band reduction of a plain dense CPU tensor that owns its whole storage, or
    ``NotImplemented`` (torch's own pickling then applies)."""
    torch = sys.modules.get("torch")
    if torch is None or type(obj) not in (torch.Tensor, torch.nn.Parameter):
        return NotImplemented
    try:
        if (
            obj.device.type != "cpu"
            or obj.layout != torch.strided
            or obj.is_quantized
            or obj.is_conj()
            or obj.is_neg()
            or not obj.is_contiguous()
            or obj.storage_offset() != 0
            or obj.untyped_storage().nbytes() != obj.numel() * obj.element_size()
            or obj.numel() * obj.element_size() < _OOB_MIN_BYTES
            or (obj.requires_grad and not obj.is_leaf)
        ):
            return NotImplemented
        raw = obj.detach().reshape(-1).view(torch.uint8).numpy()
    except Exception:
        return NotImplemented
    dtype = str(obj.dtype).removeprefix("torch.")
    return (_rebuild_tensor, (raw, dtype, tuple(obj.shape), bool(obj.requires_grad)))


def _result_pickler(f: Any, buffers: list) -> Any:
    cp = _cloudpickle()

    class _Pickler(cp.Pickler):  # type: ignore[name-defined]
        def reducer_override(self, obj: Any) -> Any:
            r = _tensor_reducer(obj)
            if r is not NotImplemented:
                return r
            return super().reducer_override(obj)

    def keep(buf: pickle.PickleBuffer) -> bool:
        if buf.raw().nbytes < _OOB_MIN_BYTES:
            return True  # small: in band
        buffers.append(buf)
        return False

    return _Pickler(f, protocol=PROTOCOL, buffer_callback=keep)


def dump_result(obj: Any, f: BinaryIO) -> None:
    buffers: list[pickle.PickleBuffer] = []
    head = io.BytesIO()
    _result_pickler(head, buffers).dump(obj)
    f.write(MAGIC)
    f.write(_LEN.pack(head.tell()))
    f.write(head.getbuffer())
    f.write(_LEN.pack(len(buffers)))
    pos = len(MAGIC) + 2 * _LEN.size + head.tell()
    for b in buffers:
        raw = b.raw()
        pos += _LEN.size
        pad = -pos % _PAGE  # each buffer starts on a page: the caller maps it in place
        f.write(_LEN.pack(raw.nbytes))
        f.write(b"\0" * pad)
        f.write(raw)
        pos += pad + raw.nbytes


def load_file(f: BinaryIO) -> Any:
    """Load what `atomic_dump` wrote (or a plain pickle)."""
    start = f.read(len(MAGIC))
    if start != MAGIC:
        f.seek(0)
        return pickle.load(f)
    (n,) = _LEN.unpack(f.read(_LEN.size))
    stream = f.read(n)
    (count,) = _LEN.unpack(f.read(_LEN.size))
    buffers: list[Any] = []
    pos = len(MAGIC) + 2 * _LEN.size + n
    for _ in range(count):
        (size,) = _LEN.unpack(f.read(_LEN.size))
        pos += _LEN.size
        pos += -pos % _PAGE
        # A private, writable mapping of the file's pages: no copy of the data; the pages stay
        # valid after the file is removed, and writes to them never reach the file.
        mm = mmap.mmap(
            f.fileno(),
            size,
            flags=mmap.MAP_PRIVATE,
            prot=mmap.PROT_READ | mmap.PROT_WRITE,
            offset=pos,
        )
        buffers.append(mm)
        pos += size
        f.seek(pos)
    return pickle.loads(stream, buffers=buffers)


def atomic_dump(obj: Any, path: str) -> None:
    """Write ``obj`` to ``path`` atomically: temp name in the same directory, then rename."""
    tmp = f"{path}.tmp.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            dump_result(obj, f)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass  # never created or already gone: nothing to clean up; the real error follows
        raise


def load_path(path: str) -> Any:
    with open(path, "rb") as f:
        return load_file(f)
