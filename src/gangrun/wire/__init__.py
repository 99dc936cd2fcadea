"""What crosses a process boundary: each format as a typed record, its writer and reader in one
module. Imports nothing else of gangrun (the exceptions are `wire.errors`), so every
process (caller, node, rank) reads and writes these formats without loading anything else."""
