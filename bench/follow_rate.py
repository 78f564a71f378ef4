"""The live reconcile's round against the full reconcile job it replaces (issue 35, point 2).

Builds a manifest of `--records` records and a run's spool of `--rows` rows (`--hosts`, 8,
100,000-row files, keys uniform random over the records: every round touches records all
over the key space, the shape that defeats caching per key bucket), starts a live reconcile
(tally.audit.reconcile.follow) over it (its first round is the full pass), then `--rounds`
times publishes one more step of every host (800k rows at the default `--per-file`) and
times the round that folds it in; then a restart: the checkpoint, a new follower resuming
from it, and its round over one more step, against the full pass.
With `--trace-memory`, the follower's memory a file as Python and numpy count it
(tracemalloc: what the follower keeps, without the libraries it loads), after the rounds and
after the restart's round; its anonymous memory counts both.
The reference, measured in the same run over the same final spool: `tally reconcile --spool`
(multi_processing, 2 workers), what the live service re-ran every round before. The final
reports are asserted to agree. Prints the ratio job / mean round.

    python -m bench.follow_rate [--rows 10000000] [--records 2000000] [--rounds 5]
        [--per-file 100000] [--hosts 8] [--trace-memory] [--dir bench/out/follow] [--keep]
"""

from __future__ import annotations

import argparse
import gc
import shutil
import time
import tracemalloc
from pathlib import Path

import numpy as np
import psutil

from bench.reconcile_rate import make_manifest
from tally.audit.core import allocator
from tally.audit.hook.segments import Segments
from tally.audit.hook.writer import LedgerWriter
from tally.audit.reconcile.follow import Follower
from tally.audit.reconcile.job import reconcile
from tally.pipeline.runners import RunnerSpec

HOSTS = 8


def write_steps(spool: Path, steps: range, manifest: tuple[np.ndarray, np.ndarray],
                seed: int, per_file: int, hosts: int = HOSTS) -> None:
    hashes, lengths = manifest
    rng = np.random.default_rng(seed)
    for h in range(hosts):
        with LedgerWriter(spool, "bench", host=h, host_count=hosts, flush_every=1,
                          fsync=False) as w:
            for step in steps:
                keys = rng.integers(0, len(hashes), per_file)
                w.write_segments(step, Segments.build(
                    row=np.arange(per_file) % 1024, record_key=keys,
                    n_tokens=lengths[keys], content_hash=hashes[keys],
                    epoch=np.zeros(per_file)))


def _anon() -> int:
    """This process' anonymous resident memory (not the page cache of mapped files)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def _cpu() -> float:
    t = psutil.Process().cpu_times()
    return t.user + t.system


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--records", type=int, default=2_000_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--per-file", type=int, default=100_000, help="rows a spool file")
    ap.add_argument("--hosts", type=int, default=HOSTS,
                    help="a file a host a step: many hosts and few rows a file is the seed "
                    "run's shape (~2,800 rows a file, ~1.8M segment files)")
    ap.add_argument("--trace-memory", action="store_true",
                    help="the follower's memory a file by tracemalloc (slower)")
    ap.add_argument("--dir", type=Path, default=Path("bench/out/follow"))
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args(argv)
    allocator.tune()  # as `tally reconcile --follow` runs (before this process starts a thread)
    root = args.dir
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    try:
        man = make_manifest(root / "m.parquet", args.records)
        spool = root / "spool"
        per_file = args.per_file
        first = args.rows // (args.hosts * per_file)
        write_steps(spool, range(first), man, 1, per_file, args.hosts)
        anon0 = _anon()
        traced = {}
        if args.trace_memory:
            tracemalloc.start()
        f = Follower(spool, root / "m.parquet", "bench", root / "live")
        t0 = time.monotonic()
        f.round()
        full_pass = time.monotonic() - t0
        print(f"backlog: {first * args.hosts * per_file:,} rows over {args.records:,} records; "
              f"the first round (a full pass) {full_pass:.1f} s")
        rounds = []
        for r in range(args.rounds):
            write_steps(spool, range(first + r, first + r + 1), man, 100 + r, per_file, args.hosts)
            t0, c0 = time.monotonic(), _cpu()
            rep = f.round()
            took, cpu = time.monotonic() - t0, _cpu() - c0
            rounds.append((took, cpu))
            print(f"round {r + 1}: {args.hosts * per_file:,} new rows over "
                  f"{f.store.rows:,} kept: {took:.2f} s, {cpu:.2f} CPU s "
                  f"({args.hosts * per_file / took / 1e6:.2f} M new rows/s)")
        assert f.full_passes == 1, f.full_passes
        anon = _anon() - anon0
        if args.trace_memory:
            gc.collect()
            traced["after_rounds"] = tracemalloc.get_traced_memory()[0] / len(f.files)
        print(f"the follower's anonymous memory: {anon / 2**20:,.0f} MiB = "
              f"{anon / args.records:.1f} bytes a record, {anon / len(f.files):,.0f} a file "
              f"({f.store.rows:,} rows kept, {len(f.files):,} files)")
        # A restart (the service's, or its idle live reconcile's): the checkpoint a stopping
        # follower leaves, the start that resumes from it, and the round after, against the
        # full pass that a restart made before checkpoints.
        t0 = time.monotonic()
        f.checkpoint()
        save_s, saved_at = time.monotonic() - t0, f.rounds
        del f
        if args.trace_memory:
            gc.collect()
            tracemalloc.stop()
            tracemalloc.start()
        t0 = time.monotonic()
        f = Follower(spool, root / "m.parquet", "bench", root / "live")
        resume_s = time.monotonic() - t0
        assert f.resumed_from == saved_at, (f.resumed_from, f.set_aside)
        last = first + args.rounds
        write_steps(spool, range(last, last + 1), man, 99, per_file, args.hosts)
        t0 = time.monotonic()
        rep = f.round()
        after_s = time.monotonic() - t0
        assert f.full_passes == 1, f.full_passes
        restart_s = resume_s + after_s
        if args.trace_memory:
            gc.collect()
            traced["resumed"] = tracemalloc.get_traced_memory()[0] / len(f.files)
            tracemalloc.stop()
            print(f"the follower's memory a file (tracemalloc, {len(f.files):,} files): "
                  f"{traced['after_rounds']:,.0f} bytes after the rounds, "
                  f"{traced['resumed']:,.0f} resumed after its round")
        size = (root / "live" / ".follow" / "checkpoint.pickle").stat().st_size
        print(f"a restart: the checkpoint {save_s:.2f} s ({size / 2**20:.1f} MiB besides the "
              f"rows), resumed in {resume_s:.2f} s, its "
              f"first round ({args.hosts * per_file:,} new rows) {after_s:.2f} s; against the full "
              f"pass {full_pass:.1f} s: {full_pass / restart_s:.0f}x")
        t0 = time.monotonic()
        job = reconcile(run_id="bench", manifest=root / "m.parquet", out=root / "job",
                        spool=spool, runner=RunnerSpec(mode="multi_processing"))
        job_s = time.monotonic() - t0
        for k in ("coverage", "verdict", "integrity"):
            assert rep[k] == job[k], (k, rep[k], job[k])
        assert [x["code"] for x in rep["findings"]] == [x["code"] for x in job["findings"]]
        mean = sum(t for t, _ in rounds) / len(rounds)
        print(f"reference: the reconcile job over the same {f.store.rows:,} rows "
              f"(multi_processing, 2 workers): {job_s:.1f} s")
        print(f"ratio job / mean round: {job_s / mean:.1f}x (mean round {mean:.2f} s; "
              f"reports agree)")
        return {"full_pass_s": full_pass, "rounds": rounds, "job_s": job_s,
                "ratio": job_s / mean, "anon_bytes": anon, "checkpoint_s": save_s,
                "resume_s": resume_s, "restart_round_s": after_s, "traced_per_file": traced}
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
