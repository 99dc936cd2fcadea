"""Arrow record batches as what the training loop asked for: torch tensors, numpy, pandas.

:func:`to_torch` makes a dict of column name -> tensor without copying where Arrow's memory
layout is the tensor's (integer and floating columns without nulls, timestamps/dates/durations
as their integer values, fixed-size lists of those as 2-D tensors); booleans (bit-packed in
Arrow) and numeric columns with nulls (floats with NaN) are converted; other columns (strings,
binary, nested lists, structs) become Python lists.
"""

from __future__ import annotations

import warnings
from typing import Any

import pyarrow as pa

_AS_INT = {
    pa.types.is_timestamp: pa.int64(),
    pa.types.is_duration: pa.int64(),
    pa.types.is_date64: pa.int64(),
    pa.types.is_date32: pa.int32(),
    pa.types.is_time32: pa.int32(),
    pa.types.is_time64: pa.int64(),
}


def _numeric(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t)


def _as_int(col: pa.Array) -> pa.Array | None:
    for test, target in _AS_INT.items():
        if test(col.type):
            return col.view(target)
    return None


def column_to_torch(col: pa.Array) -> Any:
    """One column as a tensor (zero-copy where the layout allows) or a list."""
    import torch

    t = col.type
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    as_int = _as_int(col)
    if as_int is not None and col.null_count == 0:
        col, t = as_int, as_int.type
    if _numeric(t):
        if col.null_count == 0:
            return torch.from_numpy(col.to_numpy(zero_copy_only=True))
        return torch.from_numpy(col.to_numpy(zero_copy_only=False))  # NaN for nulls
    if pa.types.is_boolean(t) and col.null_count == 0:
        return torch.from_numpy(col.to_numpy(zero_copy_only=False))
    if (
        pa.types.is_fixed_size_list(t)
        and col.null_count == 0
        and _numeric(t.value_type)
        and col.flatten().null_count == 0
    ):
        flat = col.flatten().to_numpy(zero_copy_only=True)
        return torch.from_numpy(flat).reshape(len(col), t.list_size)
    return col.to_pylist()


def to_torch(batch: pa.RecordBatch) -> dict[str, Any]:
    """``{column: tensor or list}`` of one record batch (see the module docstring)."""
    with warnings.catch_warnings():
        # Arrow's buffers are read-only; torch warns once that writing to them is undefined.
        warnings.simplefilter("ignore", UserWarning)
        return {
            name: column_to_torch(col)
            for name, col in zip(batch.schema.names, batch.columns, strict=True)
        }


def to_numpy(batch: pa.RecordBatch) -> dict[str, Any]:
    """``{column: numpy array}`` (zero-copy where the layout allows)."""
    return {
        name: col.to_numpy(zero_copy_only=False)
        for name, col in zip(batch.schema.names, batch.columns, strict=True)
    }


def as_record_batch(table: pa.Table) -> pa.RecordBatch:
    """One record batch of ``table``'s rows (no copy when each column is one chunk)."""
    if table.num_rows == 0:
        return pa.RecordBatch.from_pylist([], schema=table.schema)
    batches = table.to_batches()
    if len(batches) != 1:
        batches = table.combine_chunks().to_batches()
    return batches[0]


OUTPUTS = {"torch": to_torch, "numpy": to_numpy, "arrow": None, "pandas": None}


def convert(batch: pa.RecordBatch, output: str) -> Any:
    """``batch`` as ``output``: ``"torch"``, ``"numpy"``, ``"arrow"`` or ``"pandas"``."""
    if output == "arrow":
        return batch
    if output == "pandas":
        return batch.to_pandas()
    if output == "numpy":
        return to_numpy(batch)
    return to_torch(batch)


__all__ = ["OUTPUTS", "as_record_batch", "column_to_torch", "convert", "to_numpy", "to_torch"]
