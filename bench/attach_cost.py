"""Attach cost: what `tally.pipeline.grain_attach.audited` adds to each batch a Grain DataLoader
hands the loop, against the same loader unwrapped (the reference, measured in the same run).

The loader: a shuffled `IndexSampler` over 1M records of `--tokens` tokens, host 3 of 64,
`--rows` rows a batch, no workers. Timed: `--batches` batches from each, alternately, twice;
reported: ms a batch, the ratio audited / plain, and the training thread's time blocked in the
writer's queue. The writer's thread (reading the records back, hashing, publishing) runs beside
the loop, so the difference includes its share of the GIL.

    python -m bench.attach_cost [--batches 300] [--rows 8] [--tokens 2048]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time

import grain
import numpy as np
from absl import flags

from tally.audit import LedgerWriter
from tally.pipeline.grain_attach import audited

RECORDS = 1_000_000


class Records(grain.sources.RandomAccessDataSource):
    def __init__(self, tokens: int) -> None:
        self.tokens = tokens

    def __len__(self) -> int:
        return RECORDS

    def __getitem__(self, i: int) -> dict:
        return {"tokens": np.full(self.tokens, i % 50_000, np.int32)}

    def __repr__(self) -> str:
        return f"Records({self.tokens})"


def make(rows: int, tokens: int) -> grain.DataLoader:
    return grain.DataLoader(
        data_source=Records(tokens),
        sampler=grain.samplers.IndexSampler(RECORDS, shuffle=True, seed=1),
        operations=[grain.transforms.Batch(rows)],
        shard_options=grain.sharding.ShardOptions(3, 64), worker_count=0)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=300)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=2048)
    a = ap.parse_args(argv)
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    plain_s, audited_s, blocked = [], [], []
    work = tempfile.mkdtemp(prefix="tally-attach-bench-")
    try:
        for rep in range(2):
            it = iter(make(a.rows, a.tokens))
            next(it)
            t0 = time.perf_counter()
            for _ in range(a.batches):
                next(it)
            plain_s.append((time.perf_counter() - t0) / a.batches)
            with LedgerWriter(f"{work}/{rep}", "bench", host=3, host_count=64,
                              fsync=False) as w:
                au = iter(audited(make(a.rows, a.tokens), w))
                next(au)
                t0 = time.perf_counter()
                for _ in range(a.batches):
                    next(au)
                audited_s.append((time.perf_counter() - t0) / a.batches)
                blocked.append(w.blocked_seconds / (a.batches + 1))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res = {"plain_ms": round(1e3 * min(plain_s), 3), "audited_ms": round(1e3 * min(audited_s), 3),
           "blocked_ms": round(1e3 * min(blocked), 4)}
    res["ratio"] = round(res["audited_ms"] / res["plain_ms"], 3)
    print(f"{a.rows} rows x {a.tokens} tokens a batch: plain {res['plain_ms']} ms, audited "
          f"{res['audited_ms']} ms a batch (ratio {res['ratio']}); the loop blocked in the "
          f"writer {res['blocked_ms']} ms a batch")
    return res


if __name__ == "__main__":
    main()
