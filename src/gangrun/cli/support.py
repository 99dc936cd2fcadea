"""What the ``gangrun`` command says to a shell user: a misspelled flag's "did you mean",
a failure's log files by path (kept after the command), the file a ``-m module`` runs, and
``gangrun info``'s rows (every option and setting, and where each comes from)."""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from typing import Any


def to_a_pipe(command: Callable[[argparse.Namespace], int], ns: argparse.Namespace) -> int:
    """``command(ns)``, ending with status 0 when its reader closed the pipe
    (`gangrun logs RUN | head`: the reader has what it wanted), stdout then pointed at
    /dev/null so the interpreter's final flush raises nothing."""
    try:
        return command(ns)
    except BrokenPipeError:
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 0


def module_file(name: str) -> str:
    """The file ``python -m name`` would run, found without importing anything (so a
    package's ``__init__`` does not run in the caller); the module name when not found."""
    import importlib.machinery

    top, *rest = name.split(".")
    spec = importlib.machinery.PathFinder.find_spec(top, [os.getcwd(), *sys.path])
    origin = spec.origin if spec is not None else None
    if not origin or not os.path.isfile(origin):
        return name
    if not rest:
        main = os.path.join(os.path.dirname(origin), "__main__.py")
        return main if origin.endswith("__init__.py") and os.path.isfile(main) else origin
    base = os.path.join(os.path.dirname(origin), *rest)
    for path in (base + ".py", os.path.join(base, "__main__.py")):
        if os.path.isfile(path):
            return path
    return name


def unknown_flag(parser: argparse.ArgumentParser, args: list[str]) -> str | None:
    """The first ``--flag`` in ``args`` that ``parser`` does not know (nor abbreviates), with
    a "did you mean" when a known flag is close, as the Python API does for options."""
    # every spelling -> the flag the help shows first (--nproc -> --processes)
    known = {
        f: action.option_strings[0] for action in parser._actions for f in action.option_strings
    }
    for a in args:
        if a == "--":
            break
        if not a.startswith("--") or len(a) < 3:
            continue
        flag = a.split("=", 1)[0]
        if flag in known:
            continue
        close = difflib.get_close_matches(flag, [k for k in known if k.startswith("--")], n=1)
        if not close:
            return f"unrecognized argument {flag} ({parser.prog} --help lists them)"
        best = close[0] if close[0].startswith("--no-") else known[close[0]]
        return f"unrecognized argument {flag} (did you mean {best}?)"
    return None


_LOGS_LINE = re.compile(r"Full logs: err\.logs\(rank\), or the files in \S+")


def with_log_paths(text: str, files: dict[int, str], run_id: str, kept: bool) -> str:
    """A failure's message for a shell: its ``Full logs: err.logs(rank)`` line (which means
    nothing there) becomes the paths of the rank logs. Without ``--log-dir`` they would go
    away with this command, so they are first moved to a private directory that stays."""
    if not files or not _LOGS_LINE.search(text):
        return text
    if not kept:
        where = tempfile.mkdtemp(prefix=f"gangrun-logs-{run_id}-")  # 0700, this user's
        moved = {}
        for rank, path in sorted(files.items()):
            dest = os.path.join(where, os.path.basename(path))
            try:
                shutil.move(path, dest)
            except OSError:  # a rank that never started has no log: nothing to keep
                continue
            moved[rank] = dest
        files = moved
        if not files:
            return text
    rank_of = re.search(r"^Rank (\d+)", text) or re.search(r"rank\(s\) (\d+)", text)
    first = int(rank_of.group(1)) if rank_of and int(rank_of.group(1)) in files else min(files)
    folder = os.path.dirname(files[first])
    line = f"Full logs: {files[first]} (rank {first})"
    if len(files) > 1:
        line += f"; every rank's rank-N.log is in {folder}"
    if not kept:
        line += " (kept after this command; --log-dir DIR puts them where you choose)"
    return _LOGS_LINE.sub(lambda _: line, text, count=1)


def print_rows(rows: list[tuple[str, dict[str, Any]]]) -> None:
    """``gangrun info``'s rows: name, value (JSON), where it comes from; a rejected
    variable's value and why, beside the value in force."""
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        line = f"  {k:<{width}}  {json.dumps(v['value']):<24} {v['source']}"
        bad = v.get("rejected")
        if bad:
            line += f" (env {k}={json.dumps(bad['value'])} rejected: {bad['why']})"
        print(line)


def option_rows(opts: Any, sources: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Each option's value and source; an option group also lists each of its fields
    (``"fields"``), a setting of its own with the source of that setting."""
    import dataclasses as dc

    rows: dict[str, dict[str, Any]] = {}
    for f in dc.fields(opts):
        value = getattr(opts, f.name)
        row = {"value": _jsonable(value), "source": sources[f.name]}
        if dc.is_dataclass(value) and not isinstance(value, type):
            row["fields"] = {
                g.name: {
                    "value": _jsonable(getattr(value, g.name)),
                    "source": sources.get(f"{f.name}.{g.name}", sources[f.name]),
                }
                for g in dc.fields(value)
            }
        rows[f.name] = row
    return rows


def _jsonable(value: Any) -> Any:
    import dataclasses as dc

    if dc.is_dataclass(value) and not isinstance(value, type):  # an option group
        return {k: _jsonable(v) for k, v in dc.asdict(value).items()}
    if isinstance(value, dict) or hasattr(value, "items"):
        return dict(value)
    if isinstance(value, tuple):
        return list(value)
    return value


def setting_rows() -> dict[str, dict[str, Any]]:
    """The caller's process settings (`gangrun.wire.contract.SETTINGS`): the value in force and
    its source; a variable whose value was rejected also has ``rejected`` (value, why)."""
    from .. import settings

    return {var: s.row() for var, s in settings.read_all().items()}


__all__ = [
    "module_file",
    "unknown_flag",
    "with_log_paths",
    "option_rows",
    "print_rows",
    "setting_rows",
]
