"""The user's source in rank tracebacks.

Code defined in a notebook cell or in ``__main__`` travels by value (cloudpickle): in the rank
its frames name a file that does not exist there (``/tmp/ipykernel_NNN/123.py`` for a cell),
so tracebacks show no source line (cloudpickle even renames that file ``<dynamic-code>``).
`with_sources` captures the source of every code
object reachable from the function (its own, nested ones, and functions/classes of
``__main__`` it refers to) and wraps the function so that unpickling it in the rank registers
that source with `linecache`, gives the code its real file name back, and hands back
the plain function: the payload's
format is unchanged, and no extra frame appears in the rank's tracebacks.
"""

from __future__ import annotations

import inspect
import linecache
import logging
import os
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

MAX_SOURCE_BYTES = 4 << 20
_MAX_OBJECTS = 500


def _by_value(obj: Any) -> bool:
    mod = getattr(obj, "__module__", None)
    return mod == "__main__" or mod is None or mod not in sys.modules


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            yield from _codes(c)


def _reachable(fn: Any) -> Iterator[types.FunctionType]:
    """``fn`` and the by-value functions (and methods of by-value classes) it refers to."""
    seen: set[int] = set()
    root = inspect.unwrap(fn)
    todo = [root]
    while todo and len(seen) < _MAX_OBJECTS:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, (types.MethodType, staticmethod, classmethod)):
            todo.append(obj.__func__)
        elif isinstance(obj, property):
            todo.extend(f for f in (obj.fget, obj.fset, obj.fdel) if f is not None)
        elif isinstance(obj, type):
            if _by_value(obj):
                todo.extend(vars(obj).values())
        elif isinstance(obj, types.FunctionType):
            if not _by_value(obj):
                continue
            yield obj
            g = obj.__globals__
            for c in _codes(obj.__code__):
                todo.extend(g[n] for n in c.co_names if n in g)
            for cell in obj.__closure__ or ():
                try:
                    todo.append(cell.cell_contents)
                except ValueError:  # an empty cell (a name not yet bound): nothing to follow
                    continue


def _key(code: types.CodeType) -> str:
    return f"{getattr(code, 'co_qualname', code.co_name)}:{code.co_firstlineno}"


def capture(fn: Callable[..., Any]) -> tuple[dict[str, str], dict[str, str]]:
    """The by-value code reachable from ``fn``: ``({filename: source}, {code key: filename})``.

    cloudpickle renames the file of every by-value code object ``<dynamic-code>``; the second
    map lets the rank give each function its real file name (a cell's, ``__main__``'s) back.
    """
    sources: dict[str, str] = {}
    files: dict[str, str] = {}
    total = 0
    for f in _reachable(fn):
        name = f.__code__.co_filename
        if name not in sources:
            lines = linecache.getlines(name)
            if not lines:
                continue
            text = "".join(lines)
            total += len(text)
            if total > MAX_SOURCE_BYTES:
                break
            sources[name] = text
        files[_key(f.__code__)] = name
    return sources, files


def _refile(code: types.CodeType, filename: str) -> types.CodeType:
    consts = tuple(
        _refile(c, filename) if isinstance(c, types.CodeType) else c for c in code.co_consts
    )
    return code.replace(co_filename=filename, co_consts=consts)


def restore_filenames(fn: Any, files: dict[str, str]) -> None:
    """Give the by-value functions reachable from ``fn`` their real file names back."""
    for f in _reachable(fn):
        name = files.get(_key(f.__code__))
        if name and f.__code__.co_filename != name:
            f.__code__ = _refile(f.__code__, name)


def register(sources: dict[str, str]) -> None:
    """Make ``linecache`` (and so tracebacks) show these files' lines."""
    for name, text in sources.items():
        if os.path.exists(name) and linecache.getlines(name):
            continue  # the real file is here: it wins
        lines = text.splitlines(keepends=True)
        linecache.cache[name] = (len(text), None, lines, name)


def _restore(fn: Any, sources: dict[str, str], files: dict[str, str]) -> Any:
    register(sources)
    try:
        restore_filenames(fn, files)
    except Exception:  # never fail a rank over tracebacks: they just lack source lines
        logging.getLogger("gangrun.notebook").debug("cannot restore file names", exc_info=True)
    return fn


class WithSources:
    """``fn`` plus its captured source; unpickles as ``fn`` itself (after registering)."""

    def __init__(
        self, fn: Callable[..., Any], sources: dict[str, str], files: dict[str, str]
    ) -> None:
        self.fn = fn
        self.sources = sources
        self.files = files
        self.__wrapped__ = fn  # so size/pickling errors still name the user's function
        self.__qualname__ = getattr(fn, "__qualname__", repr(fn))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __reduce__(self) -> tuple[Any, tuple[Any, dict[str, str], dict[str, str]]]:
        return (_restore, (self.fn, self.sources, self.files))


def with_sources(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` wrapped with its by-value source, or ``fn`` itself when there is none."""
    try:
        sources, files = capture(fn)
    except Exception:  # introspection of exotic callables: tracebacks just lack lines
        return fn
    return WithSources(fn, sources, files) if sources else fn


__all__ = ["capture", "register", "with_sources", "WithSources"]
