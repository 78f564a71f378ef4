"""A run's spool read back whole, for comparing two spools row for row."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

# What a replay must reproduce of each row (not the writer's own bookkeeping columns).
ROW_COLUMNS = ["step", "host", "row", "record_key", "content_hash", "n_tokens", "epoch"]


def spool_table(spool: str | Path, run: str = "r") -> pa.Table:
    """Every segment row of `run` under `spool` (all attempts), in (step, host, row) order."""
    files = sorted(Path(spool, run).rglob("seg-*.parquet"))
    t = pa.concat_tables([pq.read_table(f, partitioning=None) for f in files])
    return t.select(ROW_COLUMNS).sort_by([("step", "ascending"), ("host", "ascending"),
                                          ("row", "ascending")])
