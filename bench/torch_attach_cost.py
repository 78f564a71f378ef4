"""Attach cost for torch: what `tally.pipeline.loaders.torch_loader.audited` adds to each batch a
torch DataLoader hands the loop, against the same loader unwrapped, measured in the same run.

The loader: a map-style dataset of 1M records of `--tokens` tokens (`input_ids`), a
DistributedSampler (host 3 of 64, shuffled), `--rows` rows a batch, no workers. Timed:
`--batches` batches from each, alternately, twice (best kept); reported: ms a batch, the
difference as a share of a `--step-ms` training step, and the training thread's time blocked in
the writer's queue. Hashing the rows' tokens runs on the writer's thread, beside the loop, so
the difference includes its share of the GIL. Then a loop of `--steps` steps of `--step-ms`
(a sleep: the GIL released, as a step waiting on its device) over each loader, wall time
compared.

    python -m bench.torch_attach_cost [--batches 300] [--rows 8] [--tokens 2048] [--steps 100]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from tally.audit import LedgerWriter
from tally.pipeline.loaders.torch_loader import audited

RECORDS = 1_000_000


class Records(Dataset):
    def __init__(self, tokens: int) -> None:
        self.tokens = tokens

    def __len__(self) -> int:
        return RECORDS

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": torch.from_numpy(np.full(self.tokens, i % 50_000, np.int64))}


def make(rows: int, tokens: int) -> DataLoader:
    ds = Records(tokens)
    return DataLoader(ds, batch_size=rows,
                      sampler=DistributedSampler(ds, num_replicas=64, rank=3, seed=1))


def per_batch(it, batches: int) -> float:
    next(it)
    t0 = time.perf_counter()
    for _ in range(batches):
        next(it)
    return (time.perf_counter() - t0) / batches


def loop(it, steps: int, step_s: float) -> float:
    next(it)
    t0 = time.perf_counter()
    for _ in range(steps):
        next(it)
        time.sleep(step_s)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=300)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--step-ms", type=float, default=50.0)
    a = ap.parse_args(argv)
    plain_s, audited_s, blocked, plain_loop, audited_loop = [], [], [], [], []
    work = tempfile.mkdtemp(prefix="tally-torch-attach-bench-")
    try:
        for rep in range(2):
            plain_s.append(per_batch(iter(make(a.rows, a.tokens)), a.batches))
            with LedgerWriter(f"{work}/{rep}", "bench", host=3, host_count=64,
                              fsync=False) as w:
                audited_s.append(per_batch(iter(audited(make(a.rows, a.tokens), w)),
                                           a.batches))
                blocked.append(w.blocked_seconds / (a.batches + 1))
            if a.steps:
                plain_loop.append(loop(iter(make(a.rows, a.tokens)), a.steps, a.step_ms / 1e3))
                with LedgerWriter(f"{work}/loop{rep}", "bench", host=3, host_count=64,
                                  fsync=False) as w:
                    audited_loop.append(loop(iter(audited(make(a.rows, a.tokens), w)),
                                             a.steps, a.step_ms / 1e3))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res = {"plain_ms": round(1e3 * min(plain_s), 3), "audited_ms": round(1e3 * min(audited_s), 3),
           "blocked_ms": round(1e3 * min(blocked), 4)}
    res["ratio"] = round(res["audited_ms"] / res["plain_ms"], 3)
    res["added_ms"] = round(res["audited_ms"] - res["plain_ms"], 3)
    res["share_of_step"] = round(res["added_ms"] / a.step_ms, 4)
    print(f"{a.rows} rows x {a.tokens} tokens a batch: plain {res['plain_ms']} ms, audited "
          f"{res['audited_ms']} ms a batch (ratio {res['ratio']}, +{res['added_ms']} ms = "
          f"{100 * res['share_of_step']:.2f}% of a {a.step_ms:g} ms step); the loop blocked in "
          f"the writer {res['blocked_ms']} ms a batch")
    if a.steps:
        res["loop_ratio"] = round(min(audited_loop) / min(plain_loop), 4)
        print(f"{a.steps} steps of {a.step_ms:g} ms: plain {min(plain_loop):.3f} s, audited "
              f"{min(audited_loop):.3f} s (ratio {res['loop_ratio']})")
    return res


if __name__ == "__main__":
    main()
