"""A Delta Lake snapshot as a `TableFiles`: its own file list (from the
transaction log, through the ``deltalake`` package), its schema and partition values.

Only the log is read through ``deltalake``; the data files are then read like any Parquet file
(through the node's cache for remote tables). What the reader could not read correctly is
refused: deletion vectors (rows deleted without rewriting the file), column mapping (physical
column names that differ from the logical ones), type widening, and any reader feature this
module does not know.
"""

from __future__ import annotations

import datetime
import os
from typing import Any
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.compute as pc

from ..listing import FileEntry
from .source import TableError, TableFiles, fs_path, is_delta_dir, parquet_files

#: Delta reader features whose tables this reader reads correctly.
SUPPORTED_READER_FEATURES = frozenset(
    {"timestampNtz", "v2Checkpoint", "vacuumProtocolCheck", "variantType", "deletionVectors"}
)


def delta_storage_options(protocol: str, options: dict[str, Any]) -> dict[str, str]:
    """``deltalake`` (object_store) options from fsspec-style ones (s3fs: ``endpoint_url``,
    ``key``, ``secret``, ``token``, ``client_kwargs.region_name``)."""
    out: dict[str, str] = {}
    if protocol in ("s3", "s3a"):
        ep = options.get("endpoint_url") or options.get("client_kwargs", {}).get("endpoint_url")
        if ep:
            out["AWS_ENDPOINT_URL"] = str(ep)
            if str(ep).startswith("http://"):
                out["AWS_ALLOW_HTTP"] = "true"
        for k, v in (("key", "AWS_ACCESS_KEY_ID"), ("secret", "AWS_SECRET_ACCESS_KEY")):
            if options.get(k):
                out[v] = str(options[k])
        if options.get("token"):
            out["AWS_SESSION_TOKEN"] = str(options["token"])
        region = options.get("client_kwargs", {}).get("region_name")
        if region:
            out["AWS_REGION"] = str(region)
    return out


def check_protocol(
    where: str,
    reader_version: int,
    reader_features: list[str] | None,
    configuration: dict[str, str],
    deletion_vectors: int,
) -> None:
    """Refuse (``TableError``) a snapshot this reader cannot read correctly."""
    if reader_version > 3:
        raise TableError(f"Delta table {where} needs reader version {reader_version} (> 3)")
    mode = configuration.get("delta.columnMapping.mode", "none")
    if reader_version == 2 and mode not in ("", "none"):
        raise TableError(
            f"Delta table {where} uses column mapping (mode {mode!r}): its Parquet column "
            "names differ from the table's, which TableDataset does not read; rewrite the "
            "table without column mapping"
        )
    unknown = sorted(set(reader_features or ()) - SUPPORTED_READER_FEATURES)
    if "columnMapping" in unknown and mode in ("", "none"):
        unknown.remove("columnMapping")  # the feature is on, but no column is mapped
    if unknown:
        raise TableError(
            f"Delta table {where} uses reader feature(s) {', '.join(unknown)}, which "
            "TableDataset cannot read correctly; it refuses the table rather than read it wrong"
        )
    if deletion_vectors:
        raise TableError(
            f"Delta table {where} has deletion vectors on {deletion_vectors} file(s) (rows "
            "deleted without rewriting the file), which TableDataset does not apply; it "
            "refuses the table rather than return deleted rows. Purge them first "
            "(REORG TABLE ... APPLY (PURGE)) or read another version"
        )


def _check_commit_time(latest: Any, version: int, want: datetime.datetime) -> None:
    """deltalake loads its earliest version for a time before the table existed: refuse that.

    ``latest`` is the table loaded at its latest version, ``version`` the one deltalake chose
    for ``want``: it is refused when no older version is kept and its commit is after ``want``.
    The history must come from the latest snapshot: ``history()`` of a table loaded at an
    older version lists the newest commits, numbered from the loaded version down."""
    newest = latest.version()
    entries = {e.get("version"): e for e in latest.history(limit=newest - version + 2)}
    if version - 1 in entries or version not in entries:
        return  # an older version exists: deltalake chose this one for its commit time
    stamp = entries[version].get("timestamp")
    if stamp is not None and stamp > want.timestamp() * 1000:
        when = datetime.datetime.fromtimestamp(stamp / 1000, datetime.timezone.utc)
        raise TableError(
            f"the table's first commit is after {want.isoformat()} (its earliest version, "
            f"{version}, was committed at {when.isoformat()})"
        )


def _table_uri(source: Any, fs: Any, path: str) -> str:
    proto = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    if proto in ("file", "local"):
        return os.path.abspath(path)
    return f"{proto}://{path}"


def open_delta(
    source: Any,
    storage_options: dict[str, Any],
    version: int | None,
    timestamp: Any,
    delta_options: dict[str, str] | None,
) -> TableFiles:
    """The snapshot of the Delta table at ``source`` (latest, ``version`` or ``timestamp``)."""
    from deltalake import DeltaTable

    if version is not None and timestamp is not None:
        raise TableError("give version= or timestamp=, not both")
    fs, path = fs_path(source, storage_options)
    proto = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    uri = _table_uri(source, fs, path)
    opts = {**delta_storage_options(proto, storage_options), **(delta_options or {})}
    if not DeltaTable.is_deltatable(uri, storage_options=opts):
        raise TableError(f"{source!r} is not a Delta table (no readable _delta_log under {uri})")
    try:
        dt = DeltaTable(uri, storage_options=opts)
    except Exception as e:  # deltalake's errors are not one class
        raise TableError(f"cannot open Delta table {source!r}: {e}") from e
    latest = dt.version()
    if version is not None or timestamp is not None:
        want: Any = int(version) if version is not None else timestamp
        if isinstance(want, str):
            want = datetime.datetime.fromisoformat(want)
        if isinstance(want, datetime.datetime) and want.tzinfo is None:
            want = want.replace(tzinfo=datetime.timezone.utc)
        try:
            if timestamp is not None:  # keep the latest snapshot for the commit times
                chosen = DeltaTable(uri, storage_options=opts)
                chosen.load_as_version(want)
                _check_commit_time(dt, chosen.version(), want)
                dt = chosen
            else:
                dt.load_as_version(want)
        except Exception as e:
            what = f"version {want}" if version is not None else f"version at or before {want}"
            raise TableError(
                f"Delta table {source!r} has no {what} (its versions go up to {latest}; "
                f"older ones may have been cleaned up): {e}"
            ) from e
    where = f"{source!r} (version {dt.version()})"
    proto_v = dt.protocol()
    dvs = 0
    if "deletionVectors" in (proto_v.reader_features or ()):
        dvs = len(pa.table(dt.deletion_vectors()))
    check_protocol(
        where,
        proto_v.min_reader_version,
        proto_v.reader_features,
        dict(dt.metadata().configuration),
        dvs,
    )
    schema = pa.schema(dt.schema().to_arrow()).remove_metadata()
    parts = list(dt.metadata().partition_columns)
    adds = pa.table(dt.get_add_actions(flatten=True))
    uris = dt.file_uris()
    rel = adds.column("path").to_pylist()
    if len(uris) != len(rel) or any(
        not unquote(u).endswith(unquote(r).lstrip("/")) for u, r in zip(uris, rel, strict=True)
    ):
        raise TableError(f"Delta table {where}: its file list and add actions disagree")
    sizes = adds.column("size_bytes").to_pylist()
    mtimes = adds.column("modification_time").to_pylist()
    values = {c: adds.column(f"partition.{c}").to_pylist() for c in parts}
    rows = []
    for i, u in enumerate(uris):
        expr = None
        for c in parts:
            v = values[c][i]
            term = (
                pc.field(c).is_null()
                if v is None
                else pc.field(c) == pa.scalar(v, schema.field(c).type)
            )
            expr = term if expr is None else expr & term
        rows.append((fs._strip_protocol(u), int(sizes[i]), str(mtimes[i]), expr))
    rows.sort(key=lambda r: r[0])
    if not rows:
        raise TableError(f"Delta table {where} has no rows (no data files)")
    return TableFiles(
        "delta",
        where,
        proto,
        [FileEntry(p, s, v) for p, s, v, _ in rows],
        schema=schema,
        partitions=[r[3] for r in rows],
        version=dt.version(),
    )


def resolve(
    source: Any,
    fmt: str,
    storage_options: dict[str, Any],
    version: int | None = None,
    timestamp: Any = None,
    delta_options: dict[str, str] | None = None,
) -> TableFiles:
    """The files of ``source`` (``fmt``: ``"auto"``, ``"parquet"`` or ``"delta"``)."""
    if fmt not in ("auto", "parquet", "delta"):
        raise TableError(f"format must be 'auto', 'parquet' or 'delta', got {fmt!r}")
    delta = is_delta_dir(source, storage_options) if fmt != "delta" else True
    if delta and fmt == "parquet":
        raise TableError(
            f"{source!r} is a Delta table (it has a _delta_log): reading its files as plain "
            "Parquet would include files the table removed; use format='delta' (or 'auto')"
        )
    if delta:
        return open_delta(source, storage_options, version, timestamp, delta_options)
    return parquet_files(source, storage_options, version, timestamp)


__all__ = [
    "resolve",
    "SUPPORTED_READER_FEATURES",
    "check_protocol",
    "delta_storage_options",
    "open_delta",
]
