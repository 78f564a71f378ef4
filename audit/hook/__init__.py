"""The training side: segments of a consumed batch, the spool's file contract, and the writer a
training loop calls. Depends on numpy, pyarrow and xxhash only (no DuckDB, no Beam, no JAX), so
that any loop (JAX, PyTorch, MaxText) can carry it."""
