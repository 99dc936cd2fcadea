"""Arrow record batches as what the training loop asked for: torch tensors, numpy, pandas.

`to_torch` makes a dict of column name -> tensor without copying where Arrow's memory
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


def column_array(col: pa.Array) -> Any:
    """One column as a numpy array a tensor can wrap (zero-copy where the layout allows), or
    a Python list (strings, binary, nested types, booleans/lists with nulls)."""
    t = col.type
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    as_int = _as_int(col)
    if as_int is not None and col.null_count == 0:
        col, t = as_int, as_int.type
    if _numeric(t):
        # no nulls: a view of Arrow's buffer; with nulls: floats with NaN
        return col.to_numpy(zero_copy_only=col.null_count == 0)
    if pa.types.is_boolean(t) and col.null_count == 0:
        return col.to_numpy(zero_copy_only=False)
    if pa.types.is_fixed_size_list(t) and col.null_count == 0 and _numeric(t.value_type):
        flat = col.flatten()
        if flat.null_count == 0:
            return flat.to_numpy(zero_copy_only=True).reshape(len(col), t.list_size)
    return col.to_pylist()


def column_to_torch(col: pa.Array) -> Any:
    """One column as a tensor (zero-copy where the layout allows) or a list."""
    import torch

    arr = column_array(col)
    if isinstance(arr, list):
        return arr
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only Arrow memory
        return torch.from_numpy(arr)


def to_torch(batch: pa.RecordBatch, pack: bool = False) -> dict[str, Any]:
    """``{column: tensor or list}`` of one record batch (see the module docstring).

    ``pack``: copy the tensors into one block of shared memory (views of one storage), so
    that handing the batch to another process (a DataLoader worker's queue) sends one shared
    memory segment instead of one per column.
    """
    arrays = {n: column_array(c) for n, c in zip(batch.schema.names, batch.columns, strict=True)}
    return as_tensors(arrays, pack)


def as_tensors(arrays: dict[str, Any], pack: bool) -> dict[str, Any]:
    import numpy as np
    import torch

    out: dict[str, Any] = {}
    if pack:
        spans, total = {}, 0
        for name, arr in arrays.items():
            if not isinstance(arr, list):
                spans[name] = total
                total += -(-arr.nbytes // 64) * 64  # 64-byte aligned views
        if spans:
            block = torch.empty(total, dtype=torch.uint8).share_memory_()
            for name, off in spans.items():
                arr = arrays[name]
                dtype = torch.from_numpy(np.empty(0, arr.dtype)).dtype
                view = block[off : off + arr.nbytes].view(dtype).view(arr.shape)
                np.copyto(view.numpy(), arr)
                out[name] = view
    with warnings.catch_warnings():
        # Arrow's buffers are read-only; torch warns once that writing to them is undefined.
        warnings.simplefilter("ignore", UserWarning)
        for name, arr in arrays.items():
            if name not in out:
                out[name] = arr if isinstance(arr, list) else torch.from_numpy(arr)
    return {name: out[name] for name in arrays}


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


def compact(batch: pa.RecordBatch) -> pa.RecordBatch:
    """A copy of ``batch`` that owns just its rows: pickling a slice of a larger batch (what a
    DataLoader worker does to hand it over) would otherwise send the whole parent buffers."""
    arrays = [pa.concat_arrays([c]) for c in batch.columns]
    return pa.RecordBatch.from_arrays(arrays, schema=batch.schema)


OUTPUTS = {"torch": to_torch, "numpy": to_numpy, "arrow": None, "pandas": None}


def convert(batch: pa.RecordBatch, output: str, pickled: bool = False) -> Any:
    """``batch`` as ``output``: ``"torch"``, ``"numpy"``, ``"arrow"`` or ``"pandas"``
    (``pickled``: it will be pickled, to another process)."""
    if output == "arrow":
        return compact(batch) if pickled else batch
    if output == "pandas":
        return batch.to_pandas()
    if output == "numpy":
        return to_numpy(batch)
    return to_torch(batch, pack=pickled)


__all__ = [
    "OUTPUTS",
    "as_record_batch",
    "column_array",
    "column_to_torch",
    "compact",
    "convert",
    "to_numpy",
    "to_torch",
]
