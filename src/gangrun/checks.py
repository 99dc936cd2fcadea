"""Mistakes caught before anything starts (pure functions; the caller raises their errors)."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .errors import LaunchError
from .wire.contract import RUN_ID


class LaunchArgumentError(LaunchError, TypeError):
    """The arguments do not fit the function's signature (nothing was started)."""


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """`` Did you mean 'x'?`` for the closest of ``choices``, or ``""``."""
    import difflib

    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


def bind_arguments(fn: Callable[..., Any], args: tuple, kwargs: Mapping[str, Any]) -> None:
    """Raise `LaunchArgumentError` when ``fn(*args, **kwargs)`` would be a TypeError."""
    target = inspect.unwrap(fn)
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):  # a builtin or C callable without a signature: let it run
        return
    try:
        sig.bind(*args, **kwargs)
    except TypeError as exc:
        name = getattr(target, "__qualname__", repr(target))
        params = sig.parameters
        takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
        named = [
            n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        ]
        hint = ""
        unknown = [k for k in kwargs if k not in params or params[k].kind is params[k].VAR_KEYWORD]
        if unknown and not takes_kwargs:
            bad = unknown[0]
            hint = f" {name}() has no parameter {bad!r}.{did_you_mean(bad, named)}"
        raise LaunchArgumentError(
            f"Bad arguments for {name}{sig}: {exc}.{hint} Nothing was started."
        ) from None


def refuse_nested(env: Mapping[str, str] | None = None) -> None:
    """Raise [`LaunchError`][gangrun.errors.LaunchError] when called inside a rank of a gangrun call."""
    env = os.environ if env is None else env
    run_id = env.get(RUN_ID)
    if not run_id:
        return
    rank = env.get("RANK", "?")
    raise LaunchError(
        f"already inside rank {rank} of call {run_id}; nested calls are not supported. "
        "Call the plain function here (train(...)), or launch from the notebook/script itself.",
        rank=int(rank) if rank.isdigit() else None,
        run_id=run_id,
    )


def hidden_gpus_message(env: Mapping[str, str], detected: int) -> str | None:
    """Why no GPU is visible when ``CUDA_VISIBLE_DEVICES`` hides them (``None`` otherwise)."""
    if detected or "CUDA_VISIBLE_DEVICES" not in env:
        return None
    value = env["CUDA_VISIBLE_DEVICES"]
    if value.strip() not in ("", "-1", "none", "NoDevFiles"):
        return None
    return (
        f"gpus= was requested but CUDA_VISIBLE_DEVICES={value!r} hides every GPU from this "
        "process. Unset it (or list the GPUs to use, e.g. CUDA_VISIBLE_DEVICES=0,1) before "
        "starting Python/the kernel, or pass processes=N to run CPU ranks."
    )


__all__ = [
    "LaunchArgumentError",
    "bind_arguments",
    "did_you_mean",
    "hidden_gpus_message",
    "refuse_nested",
]
