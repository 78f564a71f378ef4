"""Attach cost for MosaicML Streaming: what `tally.pipeline.loaders.mosaic.audited` adds to each
batch
a StreamingDataLoader over a StreamingDataset hands the loop, against the same loader
unwrapped, measured in the same run.

The data: an MDS directory of `--samples` samples of `--tokens` int32 tokens (`input_ids`),
written by streaming's own MDSWriter in a temporary directory (removed afterwards). The loader:
a StreamingDataset over it (shuffled, py1e, `num_canonical_nodes` = the world), rank
`--rank` of `--ranks` nodes (streaming's topology from RANK / WORLD_SIZE, one process: a
one-process gloo group, as tests/test_streaming_loader.py does), a StreamingDataLoader of
`--rows` rows a batch, `--workers` workers. Timed: whole epochs of each loader, alternately,
twice (best kept), from `iter()` to the last batch, so that each epoch's planning is in the
figure: streaming's own (`generate_work` in the local leader: the training process without
workers) and the audit's (the same call of the user's dataset in the training process, once an
epoch, before the workers start). Reported, a batch: wall ms, process CPU ms (every thread:
streaming's polling threads move the wall figure by milliseconds, see `epoch_per_batch`) and the
training thread's own CPU ms, each difference as a share of a `--step-ms` training step; the
audit's planning call timed alone (ms an epoch: the part of the cost paid once an epoch, on the
training thread); and the training thread's time blocked in the writer's queue. Hashing the
rows' tokens runs on the writer's thread, beside the loop (its share of the GIL). Then a loop
of `--steps` steps of `--step-ms` (a sleep: the GIL released, as a step waiting on its device)
over each loader, wall time compared.

    python -m bench.streaming_attach_cost [--samples 20000] [--tokens 2048] [--rows 8]
        [--ranks 8] [--rank 3] [--workers 0] [--steps 100] [--step-ms 50] [--plan-samples 0]

`--plan-samples N` (0: skip) also times the audit's planning call alone over a second MDS
directory of N one-token samples (what the plan costs at a larger dataset: it is a function of
the sample count and the topology, not of the samples' size).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from tally.audit import LedgerWriter
from tally.pipeline.loaders import mosaic


def write_mds(out: Path, samples: int, tokens: int) -> Path:
    """`samples` samples of `tokens` int32 tokens, by streaming's MDSWriter."""
    writer_cls = mosaic.streaming_module("streaming.base.format.mds.writer").MDSWriter
    base = np.arange(tokens, dtype=np.int32)
    with writer_cls(columns={"input_ids": f"ndarray:int32:{tokens}"}, out=str(out),
                    size_limit=1 << 26) as w:
        for i in range(samples):
            w.write({"input_ids": (base + i) % 50_000})
    return out


@contextlib.contextmanager
def world(rank: int, ranks: int) -> Iterator[None]:
    """Rank `rank` of `ranks` nodes (one rank each) for streaming, in this one process."""
    import torch.distributed as dist

    names = ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK")
    old = {k: os.environ.get(k) for k in names}
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE="1",
                      LOCAL_RANK="0")
    made = not dist.is_initialized()
    if made:  # else streaming would start a real group of `ranks` processes
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if made:
            dist.destroy_process_group()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def make(data: Path, rows: int, ranks: int, workers: int) -> Any:
    dataset_cls = mosaic.streaming_module("streaming.base.dataset").StreamingDataset
    loader_cls = mosaic.streaming_module("streaming.base.dataloader").StreamingDataLoader
    ds = dataset_cls(local=str(data), batch_size=rows, shuffle=True, shuffle_seed=1,
                     num_canonical_nodes=ranks)
    return loader_cls(ds, batch_size=rows, num_workers=workers)


def epoch_per_batch(loader: Any, writer: LedgerWriter | None = None
                    ) -> tuple[float, float, float, int]:
    """Wall, process CPU and training-thread CPU seconds a batch over one whole epoch, iter()
    (the epoch's planning) included. Process CPU counts every thread (streaming's, and the
    writer's up to its close: its last hashing and publishing); CPU is steadier than wall time,
    which streaming's polling (its iterator sleeps 7 ms whenever its ready thread is behind)
    and the box's other work move."""
    c0, m0, t0 = time.process_time(), time.thread_time(), time.perf_counter()
    n = max(sum(1 for _ in loader), 1)
    wall, main_cpu = time.perf_counter() - t0, time.thread_time() - m0
    if writer is not None:
        writer.close()
    return wall / n, (time.process_time() - c0) / n, main_cpu / n, n


def loop(loader: Any, steps: int, step_s: float) -> float:
    it = iter(loader)
    next(it)
    t0 = time.perf_counter()
    for _ in range(steps):
        next(it)
        time.sleep(step_s)
    t = time.perf_counter() - t0
    for _ in it:  # end the epoch: streaming's threads stop with it
        pass
    return t


def plan_ms(loader: Any, repeats: int = 3) -> float:
    """The audit's planning call (`generate_work` of the user's dataset), best of `repeats`."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        loader._plan()
        best = min(best, time.perf_counter() - t0)
    return 1e3 * best


def one(data: Path, a: argparse.Namespace, spool: Path | None, what: str) -> tuple:
    """Build a loader (audited into `spool` when given), run `what` on it ("epoch": one whole
    epoch; "loop": the simulated steps), and drop it before returning: streaming refuses a
    second live dataset on the same local directory."""
    w = None if spool is None else LedgerWriter(spool, "bench", host=a.rank,
                                                host_count=a.ranks, fsync=False)
    loader = make(data, a.rows, a.ranks, a.workers)
    try:
        if w is not None:
            loader = mosaic.audited(loader, w)
        if what == "plan":
            return (plan_ms(loader),)
        if what == "loop":
            return (loop(loader, a.steps, a.step_ms / 1e3),)
        per, cpu, main_cpu, n = epoch_per_batch(loader, w)
        if w is None:
            return per, cpu, main_cpu, n
        return per, cpu, main_cpu, n, w.blocked_seconds / n, plan_ms(loader)
    finally:
        if w is not None:
            w.close()
        del loader  # by refcount: gc.collect() costs ~0.4 s a call beside torch's heap


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=20_000)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--rank", type=int, default=3)
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--step-ms", type=float, default=50.0)
    ap.add_argument("--plan-samples", type=int, default=0)
    a = ap.parse_args(argv)
    plain_s, audited_s, plain_cpu, audited_cpu, blocked, plans = [], [], [], [], [], []
    plain_main, audited_main = [], []
    plain_loop, audited_loop = [], []
    big_plan = None
    work = Path(tempfile.mkdtemp(prefix="tally-streaming-attach-bench-"))
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    mosaic.streaming_module("streaming.base.format.mds.writer")  # imports out of the timing
    try:
        t0 = time.perf_counter()
        data = write_mds(work / "data", a.samples, a.tokens)
        write_s = time.perf_counter() - t0
        with world(a.rank, a.ranks):
            for rep in range(2):
                for audit in ((False, True) if rep == 0 else (True, False)):  # order alternates
                    if not audit:
                        per, cpu, main_cpu, batches = one(data, a, None, "epoch")
                        plain_s.append(per)
                        plain_cpu.append(cpu)
                        plain_main.append(main_cpu)
                        continue
                    per, cpu, main_cpu, n, block, plan = one(data, a, work / f"s{rep}",
                                                             "epoch")
                    audited_s.append(per)
                    audited_cpu.append(cpu)
                    audited_main.append(main_cpu)
                    blocked.append(block)
                    plans.append(plan)
                assert n == batches, (n, batches)
                if a.steps:
                    plain_loop.append(one(data, a, None, "loop")[0])
                    audited_loop.append(one(data, a, work / f"loop{rep}", "loop")[0])
            if a.plan_samples:
                big = write_mds(work / "big", a.plan_samples, 1)
                big_plan = one(big, a, work / "big-spool", "plan")[0]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ms = lambda xs: round(1e3 * min(xs), 3)  # noqa: E731
    res = {"batches": batches, "plain_ms": ms(plain_s), "audited_ms": ms(audited_s),
           "plain_cpu_ms": ms(plain_cpu), "audited_cpu_ms": ms(audited_cpu),
           "plain_main_ms": ms(plain_main), "audited_main_ms": ms(audited_main),
           "blocked_ms": round(1e3 * min(blocked), 4), "plan_ms": round(min(plans), 3),
           "write_s": round(write_s, 2)}
    res["ratio"] = round(res["audited_ms"] / res["plain_ms"], 3)
    res["added_ms"] = round(res["audited_ms"] - res["plain_ms"], 3)
    res["added_cpu_ms"] = round(res["audited_cpu_ms"] - res["plain_cpu_ms"], 3)
    res["added_main_ms"] = round(res["audited_main_ms"] - res["plain_main_ms"], 3)
    res["share_of_step"] = round(res["added_ms"] / a.step_ms, 4)
    res["cpu_share_of_step"] = round(res["added_cpu_ms"] / a.step_ms, 4)
    res["plan_ms_per_batch"] = round(res["plan_ms"] / batches, 4)
    print(f"{a.samples} samples (MDS written in {write_s:.1f} s), rank {a.rank} of {a.ranks}, "
          f"{a.workers} workers: {batches} batches an epoch of {a.rows} rows x {a.tokens} tokens")
    print(f"whole epochs, wall: plain {res['plain_ms']} ms, audited {res['audited_ms']} ms a "
          f"batch (ratio {res['ratio']}, {res['added_ms']:+} ms = "
          f"{100 * res['share_of_step']:.2f}% of a {a.step_ms:g} ms step); the loop blocked in "
          f"the writer {res['blocked_ms']} ms a batch")
    print(f"whole epochs, process CPU: plain {res['plain_cpu_ms']} ms, audited "
          f"{res['audited_cpu_ms']} ms a batch ({res['added_cpu_ms']:+} ms = "
          f"{100 * res['cpu_share_of_step']:.2f}% of a {a.step_ms:g} ms step); the training "
          f"thread's own: plain {res['plain_main_ms']} ms, audited {res['audited_main_ms']} ms "
          f"({res['added_main_ms']:+} ms)")
    print(f"of which the audit's plan (generate_work), once an epoch on the training thread: "
          f"{res['plan_ms']} ms = {res['plan_ms_per_batch']} ms a batch over this epoch; the "
          f"rest is per batch (pairing, handing over, the writer's hashing)")
    if big_plan is not None:
        res["big_plan_ms"] = round(big_plan, 1)
        print(f"the plan over {a.plan_samples} samples, rank {a.rank} of {a.ranks}: "
              f"{res['big_plan_ms']} ms an epoch")
    if a.steps:
        res["loop_ratio"] = round(min(audited_loop) / min(plain_loop), 4)
        print(f"{a.steps} steps of {a.step_ms:g} ms: plain {min(plain_loop):.3f} s, audited "
              f"{min(audited_loop):.3f} s (ratio {res['loop_ratio']})")
    return res

if __name__ == "__main__":
    main()
