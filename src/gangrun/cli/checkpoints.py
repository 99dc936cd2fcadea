"""``gangrun checkpoints URL``: the checkpoints of a location, verified.

One row per checkpoint directory directly under ``URL`` (any fsspec URL or directory, as a
call's ``checkpoint_dir``): its name, step (the number its name ends with), state, size and
commit time. The state is ``complete`` (every file as its marker's manifest records),
``damaged: <what>`` (a marker, but a file missing or of another size, or with
``--checksums`` another CRC-32), or ``partial: no marker`` (its save never finished). See
`gangrun.checkpoint.scan`. Credentials and endpoints come from the usual places (``AWS_*``
variables, fsspec's configuration, e.g. ``FSSPEC_S3_ENDPOINT_URL``).

Exit status 0 whatever the checkpoints' state (1 when the location is not a directory or
cannot be listed).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

EXIT_OK, EXIT_ERROR = 0, 1


def add_checkpoints_command(sub: Any) -> None:
    """The ``checkpoints`` subcommand."""
    p = sub.add_parser(
        "checkpoints",
        help="list a location's checkpoints: complete, damaged, partial",
        description="List the checkpoints directly under URL (a checkpoint_dir) with their "
        "step, state (complete / damaged: why / partial: no marker), size and commit time. "
        "Sizes are checked against each checkpoint's manifest (one listing).",
    )
    p.add_argument("url", metavar="URL", help="a checkpoint location (fsspec URL or directory)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--checksums",
        action="store_true",
        help="also compare every file's CRC-32 with its manifest (reads every byte)",
    )


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)  # pragma: no cover


def _when(t: float | None) -> str:
    if not t:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _state(r: Any) -> str:
    if r.state == "complete":
        return "complete" if r.verified else "complete (no manifest: not verifiable)"
    return f"{r.state}: {r.reason if r.state == 'damaged' else 'no marker'}"


def cmd_checkpoints(ns: argparse.Namespace) -> int:
    from .support import to_a_pipe

    return to_a_pipe(_list, ns)  # `gangrun checkpoints URL | head`


def _list(ns: argparse.Namespace) -> int:
    from ..checkpoint import filesystem, scan

    try:
        fs, root = filesystem(ns.url)
        if not fs.isdir(root):
            print(f"gangrun checkpoints: {ns.url} is not a directory", file=sys.stderr)
            return EXIT_ERROR
        reports = scan(ns.url, checksums=ns.checksums)
    except Exception as exc:  # a bad URL, credentials, an unreachable server
        why = f"{type(exc).__name__}: {exc}"
        print(f"gangrun checkpoints: cannot list {ns.url}: {why}", file=sys.stderr)
        return EXIT_ERROR
    if ns.json:
        print(json.dumps([r.to_dict() for r in reports], indent=2))
        return EXIT_OK
    if not reports:
        print(f"no checkpoints in {ns.url}")
        return EXIT_OK
    rows = [("CHECKPOINT", "STEP", "STATE", "SIZE", "TIME")]
    for r in reports:
        step = "-" if r.step is None else str(r.step)
        rows.append((r.name, step, _state(r), _size(r.size), _when(r.time)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())
    print(_holder_line(ns.url))
    return EXIT_OK


def _holder_line(url: str) -> str:
    """Who writes to the location now (its one writer: `gangrun.checkpoint.writer`)."""
    from ..checkpoint.writer import holder, lock_path, unreadable_lock

    try:
        rec = holder(url)
    except Exception as exc:  # unreadable lock file: say so, the listing stands
        return f"writer: unknown ({type(exc).__name__}: {exc})"
    if rec is None:
        return "writer: none (no live call holds this location)"
    if rec.get("unreadable"):  # torn, or not gangrun's: as a call on the location says it
        return f"writer: {unreadable_lock(lock_path(url))}."
    live = rec.get("live")
    state = "live" if live is True else "dead: the next call takes it over" if live is False else ""
    state = state or "on another host: cannot be checked from here"
    who = f"{rec.get('function', '?')} (pid {rec.get('pid', '?')} on {rec.get('host', '?')})"
    return f"writer: {who}, {state}"


__all__ = ["add_checkpoints_command", "cmd_checkpoints"]
