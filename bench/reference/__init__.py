"""What the benchmarks and the tests both measure Tally against, kept outside tests/ so that a
benchmark never imports the test suite.

- `reconcile_sql`: the reconcile numbers restated in DuckDB SQL from docs/DESIGN.md
  ("Exposure semantics"), independently of `tally.audit.reconcile` (the oracle of
  tests/test_reconcile.py and of bench/reconcile_rate.py, bench/seed_scale.py).
- `posthoc_sql`: the same for `tally diff` and `tally exposure` ("Post-hoc audits";
  tests/test_posthoc.py, bench/diff_rate.py).
- `dask_cluster`: a real multi-process dask.distributed cluster on 127.0.0.1 (separate
  `dask scheduler` and `dask worker` processes; tests/test_dask_cluster.py,
  bench/dask_scaling.py).
"""
