"""Replay rate: `tally replay` of a Grain DataLoader against running that loader.

Setup (not timed): a manifest of `--records` train records (written directly).

Timed:
(a) reference: the loader itself, one host's `grain.DataLoader` (the same factory, a source that
    returns a 16-token record) iterated `--reference-steps` batches in one process: the record
    keys a run's loader yields per second;
(b) `tally replay` (a process of its own, `--workers` processes) of `--hosts` hosts x `--steps`
    steps x `--rows` rows per host, hashes from the manifest, spool written; keys/s;
for two samplers: Grain's `IndexSampler` with shuffle (keys by Grain's index shuffle, one call a
record) and an OLMo-style block sampler (a permutation per epoch; one `sampler[i]` a record).
Prints keys/s, the ratio (b)/(a), and the seed run's shape extrapolated (1.41M steps x 512 rows
over 64 hosts: ~722M keys). The spool and manifest are removed at the end.

    python -m bench.replay_rate [--hosts 64] [--steps 10000] [--rows 8] [--records 10000000]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grain
import numpy as np

from bench.preflight_rate import write_manifest

SEED_KEYS = 1_410_000 * 512  # the seed run: 1.41M steps x 512 rows (64 hosts x 8)


class Records(grain.sources.RandomAccessDataSource):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"tokens": np.full(16, i % 50_000, np.int32)}

    def __repr__(self) -> str:
        return f"Records({self.n})"


class Block:
    """OLMo-style: this host's contiguous block of epoch e's permutation (cached per epoch)."""

    def __init__(self, total: int, seed: int) -> None:
        self.total, self.seed, self._cache = total, seed, None

    def __len__(self) -> int:  # endless; without a length Grain searches for the end when
        return sys.maxsize     # the loader is made (~63 lookups, a permutation each)

    def __getitem__(self, index: int) -> grain.RecordMetadata:
        epoch, within = divmod(int(index), self.total)
        if self._cache is None or self._cache[0] != epoch:
            self._cache = (epoch, np.random.default_rng([self.seed, epoch]).permutation(
                self.total))
        return grain.RecordMetadata(index=index, record_key=int(self._cache[1][within]))

    def __repr__(self) -> str:
        return f"Block({self.total}, {self.seed})"


def make_loader(host: int, hosts: int) -> grain.DataLoader:
    """The factory `tally replay --loader bench.replay_rate:make_loader` calls (environment:
    TALLY_BENCH_RECORDS, TALLY_BENCH_ROWS, TALLY_BENCH_SAMPLER index|block)."""
    n = int(os.environ["TALLY_BENCH_RECORDS"])
    sampler = (grain.samplers.IndexSampler(n, shuffle=True, seed=11)
               if os.environ.get("TALLY_BENCH_SAMPLER", "index") == "index" else Block(n, 11))
    return grain.DataLoader(
        data_source=Records(n), sampler=sampler,
        operations=[grain.transforms.Batch(int(os.environ["TALLY_BENCH_ROWS"]),
                                           drop_remainder=True)],
        shard_options=grain.sharding.ShardOptions(host, hosts, drop_remainder=True),
        worker_count=0)


def reference(hosts: int, steps: int) -> float:
    """Keys per second one host's loader yields (host 0 of `hosts`)."""
    it = iter(make_loader(0, hosts))
    next(it)  # the first batch pays the sampler's first epoch
    rows = int(os.environ["TALLY_BENCH_ROWS"])
    t0 = time.perf_counter()
    for _ in range(steps):
        next(it)
    return steps * rows / (time.perf_counter() - t0)


def replay(work: Path, hosts: int, steps: int, manifest: Path, workers: int | None,
           run: str) -> dict:
    cmd = [sys.executable, "-m", "tally.audit.cli", "replay", "--loader",
           "bench.replay_rate:make_loader", "--hosts", str(hosts), "--steps", str(steps),
           "--spool", str(work / "spool"), "--run", run, "--manifest", str(manifest), "--json"]
    if workers:
        cmd += ["--workers", str(workers)]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parent.parent)
    if r.returncode:
        raise SystemExit(f"replay failed: {r.stderr}")
    out = json.loads(r.stdout)
    out["wall_seconds"] = round(time.perf_counter() - t0, 2)  # with the process's start-up
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--rows", type=int, default=8, help="rows per host per step")
    ap.add_argument("--records", type=int, default=10_000_000)
    ap.add_argument("--reference-steps", type=int, default=2_000)
    ap.add_argument("--workers", type=int, help="replay processes (default: one per core)")
    ap.add_argument("--samplers", default="index,block")
    ap.add_argument("--dir", help="work directory (default: a temporary one, removed)")
    a = ap.parse_args(argv)
    work = Path(a.dir or tempfile.mkdtemp(prefix="tally-replay-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ.update(TALLY_BENCH_RECORDS=str(a.records), TALLY_BENCH_ROWS=str(a.rows))
    results: dict = {"hosts": a.hosts, "steps": a.steps, "rows": a.rows,
                     "records": a.records, "keys": a.hosts * a.steps * a.rows}
    try:
        manifest = work / "manifest.parquet"
        write_manifest(manifest, a.records)
        for kind in a.samplers.split(","):
            os.environ["TALLY_BENCH_SAMPLER"] = kind
            ref = reference(a.hosts, a.reference_steps)
            out = replay(work, a.hosts, a.steps, manifest, a.workers, f"bench-{kind}")
            shutil.rmtree(work / "spool", ignore_errors=True)
            rate = out["keys_per_second"]
            res = {"loader_keys_per_s": round(ref), "replay_keys_per_s": rate,
                   "replay_seconds": out["seconds"], "wall_seconds": out["wall_seconds"],
                   "ratio": round(rate / ref, 2), "files": out["files"],
                   "seed_run_minutes": round(SEED_KEYS / rate / 60, 1)}
            results[kind] = res
            print(f"{kind:6s} sampler: loader {ref:,.0f} keys/s (one host, in process); replay "
                  f"{a.hosts} hosts x {a.steps:,} steps x {a.rows} rows = {results['keys']:,} "
                  f"keys in {out['seconds']:.1f} s ({out['wall_seconds']:.1f} s with start-up): "
                  f"{rate:,} keys/s, ratio {res['ratio']:.2f}; the seed run's "
                  f"{SEED_KEYS / 1e6:,.0f}M keys: ~{res['seed_run_minutes']} min")
    finally:
        if not a.dir:
            shutil.rmtree(work, ignore_errors=True)
    return results


if __name__ == "__main__":
    main()
