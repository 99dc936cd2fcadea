"""Errors of reading a dataset's files that say which file (and row group) failed, on which
rank and in which DataLoader worker: `DataReadError`, chained to the original error.

A corrupt Parquet data page fails deep in pyarrow with "Couldn't deserialize thrift ..." or
"Corrupt snappy compressed data", a damaged string column only when its rows are converted,
a cache fill with the storage's own error; none of them says which file it was. The readers
(`source.Reader`, `TableDataset`'s hand-over, `prefetch.stream` for `VolumeDataset`
and the cache fills) turn what they catch into a `DataReadError` naming it. It is an
``OSError``: torch's DataLoader rebuilds it in the training process from its message (which
keeps the worker's traceback, the original error's included), and a rank's error reaches the
caller with the message whole.

This module imports neither torch nor pyarrow.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

#: what to do about a file that cannot be read (the default hint of `read_error`)
HINT = (
    "The file is damaged, was changed or removed while the epoch read it, or its storage "
    "failed: check it, rewrite or remove it, and run again."
)


class DataReadError(OSError):
    """A file of a `TableDataset` or a `VolumeDataset` could not be read, decoded or handed over.
    The message names the file (for a table, the row group), the rank and the DataLoader
    worker; ``__cause__`` is the original error (in a worker's error rebuilt by the DataLoader,
    its traceback is in the message)."""

    def __init__(self, *args: object) -> None:
        # torch's DataLoader rebuilds a worker's error as ``DataReadError("Caught
        # DataReadError in DataLoader worker process 0. Original Traceback ...")``, where what
        # was read comes last: put it first, so the first line (the caller's) names the file
        if len(args) == 1 and isinstance(args[0], str) and args[0].startswith("Caught "):
            text = args[0]
            at = text.rfind(f"{__name__}.DataReadError: ")
            if at >= 0 and "Original Traceback" in text:
                said = text[at:].split(": ", 1)[1].split("\n", 1)[0].strip()
                args = (f"{said}\n\n{text.rstrip()}",)
        super().__init__(*args)


def _rank(rank: int | None) -> str:
    if rank is None:
        env = os.environ.get("RANK")
        rank = int(env) if env and env.isdigit() else None
    return "" if rank is None else f" on rank {rank}"


def _worker() -> str:
    data = sys.modules.get("torch.utils.data")  # loaded by every DataLoader worker
    info = data.get_worker_info() if data is not None else None
    return f" (DataLoader worker {info.id})" if info is not None else ""


def place(path: str, row_group: int | None = None, copy: str | None = None) -> str:
    """How a message names a file: ``'path'``, its row group, its copy in the node cache."""
    out = repr(path) if row_group is None else f"row group {row_group} of {path!r}"
    if copy is not None and copy != path:
        out += f" (read from its copy in the node cache, {copy})"
    return out


def read_error(
    what: str,
    places: Sequence[str],
    exc: BaseException,
    rank: int | None = None,
    doing: str = "could not read",
    hint: str = HINT,
) -> DataReadError:
    """A `DataReadError` for ``exc``: ``what`` (``"TableDataset"``) ``doing`` ``places``
    (from `place`) on ``rank`` (default: ``RANK``), in the current DataLoader worker.
    Raise it ``from exc``."""
    names = list(dict.fromkeys(places))
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    said = " ".join(str(exc).split())  # pyarrow's messages span lines
    end = "" if said.endswith(".") else "."
    return DataReadError(
        f"{what}{_rank(rank)}{_worker()} {doing} {shown}: {type(exc).__name__}: {said}{end} {hint}"
    )


__all__ = ["DataReadError", "HINT", "place", "read_error"]
