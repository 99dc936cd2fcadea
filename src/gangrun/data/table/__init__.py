"""`TableDataset` and its parts: batches of a Parquet or Delta Lake table.

- ``dataset``: `TableDataset` (the resume API `VolumeDataset` has);
- ``loader``: `TableLoader`, the DataLoader that keeps the table's workers;
- ``plan``: the split arithmetic across ranks and workers (pure: no pyarrow, no torch);
- ``source``: the table's files, schema and row groups, and reading one (pyarrow);
- ``delta``: Delta Lake snapshots (deltalake);
- ``convert``: Arrow batches to tensors;
- ``handover``: how DataLoader workers hand batches to the main process (shared-memory
  blocks, Arrow IPC).

Nothing is imported here, so ``import gangrun.data.table.plan`` imports neither torch nor
pyarrow; the public names are ``gangrun.data.TableDataset``, ``TableLoader``, ``TableError``.
"""
