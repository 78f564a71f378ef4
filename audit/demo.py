"""`tally demo`: the smallest real end-to-end path, on embedded defaults.

Two hosts consume a small synthetic corpus through a correctly sharded loop, crash, resume from
a checkpoint at step 30 as attempt 1, and every consumed batch goes through the real ledger
writer into a spool, which is then ingested into a DuckDB ledger and summarised.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from audit.cli import format_overview
from audit.ingest import ingest
from audit.ledger import Ledger
from audit.writer import LedgerWriter

HOSTS, ROWS, LENGTH, RECORDS, STEPS = 2, 8, 128, 1024, 60


def _batches(corpus: list[np.ndarray], host: int, steps: range, seed: int = 0):
    """One global shuffle per epoch, sliced per host: the correct way to shard."""
    per_step = HOSTS * ROWS
    for step in steps:
        epoch, pos = divmod(step * per_step, len(corpus))
        order = np.random.default_rng(seed + epoch).permutation(len(corpus))
        keys = order[pos + host * ROWS: pos + (host + 1) * ROWS]
        tokens = np.zeros((ROWS, LENGTH), np.int32)
        seg = np.zeros((ROWS, LENGTH), np.int32)
        for r, k in enumerate(keys):
            doc = corpus[k][:LENGTH]
            tokens[r, : len(doc)], seg[r, : len(doc)] = doc, 1
        yield step, {"tokens": tokens, "tokens_segment_ids": seg,
                     "key": epoch * len(corpus) + keys.astype(np.int64)}


def run_demo(out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    rng = np.random.default_rng(0)
    corpus = [rng.integers(0, 32000, rng.integers(16, LENGTH), dtype=np.int32)
              for _ in range(RECORDS)]
    spool = out / "spool"
    for attempt, steps, crash_at in ((0, range(0, 45), 45), (1, range(30, STEPS), None)):
        for host in range(HOSTS):
            with LedgerWriter(spool, "demo", host=host, host_count=HOSTS, attempt=attempt,
                              resumed_from_step=30 if attempt else None,
                              records_per_epoch=RECORDS, flush_every=10) as w:
                for step, batch in _batches(corpus, host, steps):
                    w.write_batch(step, batch)
        if crash_at is not None:
            print(f"attempt {attempt}: hosts stopped at step {crash_at}; resuming from step 30")
    with Ledger(out / "ledger.duckdb") as ledger:
        result = ingest(spool, ledger)
        print(result.summary())
        print(format_overview(ledger.overview(), out / "ledger.duckdb"))
