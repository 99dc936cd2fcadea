"""Test tables written by pyarrow and by deltalake itself (shared by unit and system tests).

Every row has a unique ``id``; row groups are uneven on purpose.
"""

from __future__ import annotations

import io
from typing import Any

PARQUET_FILES = [(1300, [128, 300, 77]), (700, [700]), (1001, [97])]  # rows, row group sizes
PARQUET_ROWS = sum(n for n, _ in PARQUET_FILES)  # 3001: odd, 2 ranks cannot split it evenly
DELTA_V0, DELTA_V1 = 1800, 1200  # version 0 rows, rows appended by version 1 (3000: even)


def _rows(lo: int, n: int, extra: bool = False) -> Any:
    import pyarrow as pa

    ids = list(range(lo, lo + n))
    cols = {
        "id": pa.array(ids, pa.int64()),
        "x": pa.array([i * 0.5 for i in ids], pa.float32()),
        "label": pa.array([f"r{i}" for i in ids]),
        "emb": pa.array([[float(i)] * 4 for i in ids], pa.list_(pa.float32(), 4)),
    }
    if extra:
        cols["extra"] = pa.array([i % 7 for i in ids], pa.int32())
    return pa.table(cols)


def write_parquet(root: str, storage_options: dict[str, Any] | None = None) -> set[int]:
    """Three Parquet files (uneven row groups) under ``root`` (any fsspec URL); their ids."""
    import pyarrow.parquet as pq
    from fsspec.core import url_to_fs

    fs, path = url_to_fs(root, **(storage_options or {}))
    fs.makedirs(path, exist_ok=True)
    lo = 0
    for k, (n, groups) in enumerate(PARQUET_FILES):
        table = _rows(lo, n)
        buf = io.BytesIO()
        with pq.ParquetWriter(buf, table.schema) as w:
            off, g = 0, 0
            while off < n:
                size = groups[g % len(groups)]
                w.write_table(table.slice(off, size), row_group_size=size)
                off, g = off + size, g + 1
        fs.pipe_file(f"{path}/part-{k:03d}.parquet", buf.getvalue())
        lo += n
    fs.pipe_file(f"{path}/_SUCCESS", b"")  # a Spark marker: not part of the table
    return set(range(PARQUET_ROWS))


def delta_options(endpoint: str | None) -> dict[str, str]:
    """deltalake storage options for the moto server at ``endpoint`` (None: local)."""
    if endpoint is None:
        return {}
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ALLOW_HTTP": "true",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
        "AWS_S3_ALLOW_UNSAFE_RENAME": "true",
    }


def write_delta(uri: str, endpoint: str | None = None) -> tuple[set[int], set[int]]:
    """A Delta table written by deltalake: version 0 (partitioned by ``part``), then version 1
    appending rows with an added column ``extra``. Returns the ids of both versions."""
    import pyarrow as pa
    from deltalake import WriterProperties, write_deltalake

    opts = delta_options(endpoint)
    v0 = _rows(0, DELTA_V0).drop_columns(["emb"])
    v0 = v0.append_column("part", pa.array(["a", "b", "c"][i % 3] for i in range(DELTA_V0)))
    write_deltalake(
        uri,
        v0,
        partition_by=["part"],
        storage_options=opts,
        writer_properties=WriterProperties(max_row_group_size=137),
    )
    v1 = _rows(DELTA_V0, DELTA_V1, extra=True).drop_columns(["emb"])
    v1 = v1.append_column("part", pa.array(["a"] * DELTA_V1))
    write_deltalake(
        uri,
        v1,
        mode="append",
        schema_mode="merge",
        storage_options=opts,
        writer_properties=WriterProperties(max_row_group_size=251),
    )
    return set(range(DELTA_V0)), set(range(DELTA_V0 + DELTA_V1))


def in_pool(ds: Any, address: int) -> bool:
    """Whether memory at ``address`` lies in one of ``ds``'s shared memory pool blocks
    (TableLoader's hand-over: `gangrun.data.table.handover.BlockPool`)."""
    pool = ds.pool
    return pool is not None and any(
        b.ctypes.data <= address < b.ctypes.data + pool.block_bytes
        for b in (pool.block(i) for i in range(pool.workers * pool.per_worker))
    )


def corrupt_page(path: str, row_group: int, column: int, at: str = "middle") -> None:
    """Overwrite 8 bytes of a data page of ``column`` in ``row_group`` of the local Parquet
    file ``path``, keeping its footer intact: ``at="header"`` in the page's header (pyarrow:
    "Couldn't deserialize thrift"), ``"middle"`` in the middle of its (dictionary-encoded)
    data ("Unexpected end of stream")."""
    import pyarrow.parquet as pq

    chunk = pq.read_metadata(path).row_group(row_group).column(column)
    page = chunk.data_page_offset
    end = (chunk.dictionary_page_offset or page) + chunk.total_compressed_size
    with open(path, "r+b") as f:
        f.seek(page + 2 if at == "header" else page + (end - page) // 2)
        f.write(b"\xff" * 8)
    assert pq.read_metadata(path).num_rows > 0  # the footer still reads


def write_bad_utf8(path: str) -> None:
    """A Parquet file of 1000 rows (``id``, ``label``; row groups of 500) whose row group 1
    holds a ``label`` that is not UTF-8: it reads, and fails only when converted."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    t = pa.table({"id": list(range(1000)), "label": [f"row-{i:06d}" for i in range(1000)]})
    pq.write_table(t, path, compression="none", use_dictionary=False, row_group_size=500)
    chunk = pq.read_metadata(path).row_group(1).column(1)
    with open(path, "r+b") as f:
        data = f.read()
        at = data.index(b"row-000700", chunk.data_page_offset)
        f.seek(at + 5)
        f.write(b"\xff\xfe")
