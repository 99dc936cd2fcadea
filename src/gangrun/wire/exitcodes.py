"""Exit codes as the launchers report them (negative: killed by that signal). Dependency-free,
so ``import gangrun`` stays light."""

from __future__ import annotations

import signal as _signal


def signal_name(exitcode: int | None) -> str | None:
    """``-9`` -> ``"SIGKILL"``; ``None`` for normal exit codes."""
    if exitcode is None or exitcode >= 0:
        return None
    try:
        return _signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


__all__ = ["signal_name"]
