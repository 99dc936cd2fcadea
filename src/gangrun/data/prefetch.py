"""Reading a worker's files in order, with misses fetched ahead in background threads.

`stream` turns a worker's list of files into ``(sample, progress)`` pairs. Files at hand
(cache hits, local files) are read inline; after a miss the next ``prefetch`` files are fetched
in the background, several at a time, and the window is kept full until hits resume. An error
reading or decoding a file, inline or in the background, is handed to ``on_error`` with the
file, so the error raised names it. This module does not import torch or fsspec.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NoReturn, TypeVar

T = TypeVar("T")
#: ``on_error(file, stage, error)`` -> the error to raise instead (chained), or None: as it is;
#: ``stage`` is ``"read"`` or ``"decode"``
OnError = Callable[[Any, str, Exception], "BaseException | None"]

#: progress of a worker: (file position, samples of that file done, samples yielded in all);
#: after a file's last sample, (the next file's position, 0, yielded)
Progress = tuple[int, int, int]
_END = object()


def decoded(decode: Callable[[bytes], Any] | None, data: bytes) -> Iterable[Any]:
    """The samples of one file: ``decode(data)`` is one sample, or an iterator of samples."""
    if decode is None:
        return (data,)
    out = decode(data)
    if isinstance(out, (Iterator, types.GeneratorType)):
        return out
    return (out,)


def stream(
    files: Sequence[T],
    quota: int | None,
    start: Sequence[int] | None,
    *,
    read: Callable[[T], bytes],
    hit: Callable[[T], bytes | None] | None,
    decode: Callable[[bytes], Any] | None,
    prefetch: int,
    skips: Sequence[int] | None = None,
    on_error: OnError | None = None,
) -> Iterator[tuple[Any, Progress]]:
    """``(sample, progress)`` pairs of ``files``, from position ``start`` (a saved progress).

    ``read(f)`` fetches a file; ``hit(f)`` returns its bytes when they are at hand without
    waiting (else ``None``), or is ``None`` when nothing ever is. With a ``quota`` the files
    are cycled until that many samples are yielded; otherwise each file is read once.
    ``prefetch`` is the read-ahead window after a miss (0: no background threads).
    ``skips[i]``: samples of file ``i`` already read elsewhere (the rest of an epoch resumed on
    another layout, `gangrun.data.elastic`); its progress counts them.
    ``on_error`` names the file in an error reading or decoding it (see `OnError`).
    """
    fpos, skip, yielded = (list(start) + [0, 0, 0])[:3] if start else (0, 0, 0)
    if skips is not None and fpos < len(skips):
        skip = max(skip, skips[fpos])
    if quota is not None and yielded >= quota:
        return
    if not files:
        if quota:
            raise ValueError("samples_per_rank > 0 but this rank has no files to read")
        return
    n = len(files)
    limit = n if quota is None else None
    pool = (
        ThreadPoolExecutor(min(prefetch, 16), thread_name_prefix="gangrun-prefetch")
        if prefetch
        else None
    )
    ahead: dict[int, Future[bytes]] = {}
    empty_run = 0
    try:
        while limit is None or fpos < limit:
            fut = ahead.pop(fpos, None) if ahead else None
            try:
                if fut is not None:
                    data: bytes | None = fut.result()
                else:
                    data = hit(files[fpos % n]) if hit is not None else None
            except Exception as e:
                _fail(on_error, files[fpos % n], "read", e)
            if pool is not None and (fut is not None or data is None):
                last = fpos + prefetch if limit is None else min(fpos + prefetch, limit - 1)
                for i in range(fpos + 1, last + 1):
                    if i not in ahead:
                        ahead[i] = pool.submit(read, files[i % n])
            if data is None:
                try:
                    data = read(files[fpos % n])
                except Exception as e:
                    _fail(on_error, files[fpos % n], "read", e)
            if decode is None and not skip:  # the common case, without a per-sample loop
                k = 1
                yielded += 1
                yield data, (fpos + 1, 0, yielded)  # the file is done: its one sample read
                if quota is not None and yielded >= quota:
                    return
            else:
                # one sample ahead, so the last sample of a file says the file is done
                # (``(next file, 0, ...)``): a rest of the epoch then knows it is finished
                k = 0
                it = _named(decoded, decode, data, on_error, files[fpos % n])
                cur = next(it, _END)
                while cur is not _END:
                    nxt = next(it, _END)
                    k += 1
                    if k > skip:
                        yielded += 1
                        yield cur, ((fpos + 1, 0, yielded) if nxt is _END else (fpos, k, yielded))
                        if quota is not None and yielded >= quota:
                            return
                    cur = nxt
            empty_run = empty_run + 1 if k == 0 else 0
            if quota is not None and empty_run > n:
                raise ValueError("samples_per_rank: none of this rank's files holds a sample")
            fpos += 1
            skip = skips[fpos] if skips is not None and fpos < len(skips) else 0
    finally:
        if pool is not None:
            for pending in ahead.values():
                pending.cancel()
            pool.shutdown(wait=False)


def _fail(on_error: OnError | None, file: Any, stage: str, error: Exception) -> NoReturn:
    """Raise ``on_error``'s error for ``error`` (chained), else ``error`` itself."""
    other = on_error(file, stage, error) if on_error is not None else None
    if other is None or other is error:
        raise error
    raise other from error


def _named(
    samples: Callable[[Any, bytes], Iterable[Any]],
    decode: Callable[[bytes], Any] | None,
    data: bytes,
    on_error: OnError | None,
    file: Any,
) -> Iterator[Any]:
    """The samples of ``data``; an error of ``decode`` (or of its iterator) names ``file``.
    An error thrown in at a ``yield`` (the consumer's) is not the decoder's: it passes as is."""
    try:
        it = iter(samples(decode, data))
    except Exception as e:
        _fail(on_error, file, "decode", e)
    while True:
        try:
            sample = next(it)
        except StopIteration:
            return
        except Exception as e:
            _fail(on_error, file, "decode", e)
        yield sample


__all__ = ["OnError", "Progress", "decoded", "stream"]
