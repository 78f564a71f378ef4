"""Hook cost: what the ledger writer costs a training loop.

Measures, for a 512 x 8192-token batch per step:
1. hashing rate of `segments_from_batch` (GB/s of token bytes, one core), unpacked and packed;
2. the time the training thread is blocked in `write_batch` per step, and the wall-clock
   overhead of a loop with the writer against the same loop without it. The simulated step
   waits with the GIL released, as a JAX step waiting on its device does.

    python -m bench.hook_cost [--steps 200] [--step-ms 50]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np

from tally.audit.hook.segments import segments_from_batch
from tally.audit.hook.writer import LedgerWriter

ROWS, LENGTH = 512, 8192


def unpacked(rng: np.random.Generator, base: int) -> dict[str, np.ndarray]:
    return {"tokens": rng.integers(0, 50_000, (ROWS, LENGTH), dtype=np.int32),
            "key": np.arange(base, base + ROWS, dtype=np.int64)}


def packed(rng: np.random.Generator, base: int, mean_len: float = 600.0) -> dict[str, np.ndarray]:
    """Rows filled with log-normal documents (median ~600 tokens), as first-fit packing does."""
    seg = np.zeros((ROWS, LENGTH), np.int32)
    key = np.zeros((ROWS, LENGTH), np.int64)
    k = base
    for r in range(ROWS):
        col, sid = 0, 1
        while col < LENGTH:
            n = int(min(LENGTH - col, max(1, rng.lognormal(np.log(mean_len), 1.0))))
            seg[r, col:col + n], key[r, col:col + n] = sid, k
            col, sid, k = col + n, sid + 1, k + 1
    return {"tokens": rng.integers(0, 50_000, (ROWS, LENGTH), dtype=np.int32),
            "tokens_segment_ids": seg, "key": key}


def hashing_rate(batch: dict[str, np.ndarray], repeats: int) -> tuple[float, int]:
    segments_from_batch(batch)  # warm up
    t0 = time.perf_counter()
    for _ in range(repeats):
        n = len(segments_from_batch(batch))
    dt = (time.perf_counter() - t0) / repeats
    return batch["tokens"].nbytes / dt / 1e9, n


def loop(steps: int, step_s: float, batches: list, writer: LedgerWriter | None) -> tuple:
    blocked = []
    t0 = time.perf_counter()
    for step in range(steps):
        time.sleep(step_s)  # the device step; GIL released like a JAX step
        if writer is not None:
            t = time.perf_counter()
            writer.write_batch(step, batches[step % len(batches)])
            blocked.append(time.perf_counter() - t)
    if writer is not None:
        writer.close()
    return time.perf_counter() - t0, np.array(blocked)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--step-ms", type=float, default=50.0)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    res: dict = {}
    for name, make in (("unpacked", unpacked), ("packed", packed)):
        gbs, n = hashing_rate(make(rng, 0), args.repeats)
        res[f"hash_{name}_gbs"], res[f"hash_{name}_segments"] = gbs, n
        print(f"hashing {name}: {n} segments per step, {gbs:.1f} GB/s on one core "
              f"({ROWS * LENGTH * 4 / gbs / 1e6:.2f} ms per step)")
    batches = [packed(rng, i * 100_000) for i in range(4)]
    step_s = args.step_ms / 1e3
    bare, _ = loop(args.steps, step_s, batches, None)
    with tempfile.TemporaryDirectory() as d:
        w = LedgerWriter(d, "bench", flush_every=50)
        hooked, blocked = loop(args.steps, step_s, batches, w)
    res.update(bare_s=bare, hooked_s=hooked, overhead=(hooked - bare) / bare,
               blocked_mean_ms=blocked.mean() * 1e3, blocked_p99_ms=np.quantile(blocked, .99) * 1e3,
               blocked_max_ms=blocked.max() * 1e3, background_ms_per_step=w.background_seconds
               / args.steps * 1e3)
    print(f"loop of {args.steps} steps x {args.step_ms:.0f} ms (packed batches): "
          f"bare {bare:.3f} s, with writer {hooked:.3f} s, ratio {hooked / bare:.4f} "
          f"(overhead {res['overhead'] * 100:+.2f}%)")
    print(f"training thread blocked per step: mean {res['blocked_mean_ms']:.3f} ms, "
          f"p99 {res['blocked_p99_ms']:.3f} ms, max {res['blocked_max_ms']:.3f} ms; "
          f"writer thread {res['background_ms_per_step']:.2f} ms/step (hash + publish)")
    return res


if __name__ == "__main__":
    main()
