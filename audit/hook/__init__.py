"""The training side: segments of a consumed batch, the spool's file contract, and the writer a
training loop calls. Depends on numpy, pyarrow and xxhash only (no DuckDB, no Beam, no JAX), so
that any loop (JAX, PyTorch, MaxText) can carry it.

The public face (`__all__`): `segments` (a batch's segments), `spool` (the file contract the
ledger and the jobs read) and `writer` (`LedgerWriter`, what a loop and the loaders' adapters
write with)."""

__all__ = ["segments", "spool", "writer"]
