"""Diff throughput and memory: `tally diff` (Beam) against the DuckDB SQL reference.

Builds a manifest of `--records` records and two runs of `--rows` consumption rows each (8 hosts,
`--file-rows`-row segment files, keys drawn uniformly): run B consumes what run A does for the
first half of the steps and other records after that, so the diff has identical steps, a first
divergent step and records seen by one run only. Both runs are ingested into a ledger; then it
times (a) the DuckDB SQL reference (bench/reference/posthoc_sql.py: the same numbers, one query
each) and (b) `tally diff` of A from the spool against B from the spool on FnApiRunner
(multi_processing by default), with the peak resident memory and CPU seconds of the process
tree, and checks that they agree.

    python -m bench.diff_rate [--rows 20000000] [--records 5000000] [--mode multi_processing]
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from bench.reconcile_rate import PeakRSS, make_manifest
from tally.audit.hook.segments import Segments
from tally.audit.hook.writer import LedgerWriter
from tally.audit.ledger.database import Ledger
from tally.audit.ledger.ingest import ingest
from tally.audit.posthoc.diff import diff
from tally.audit.posthoc.sources import run_source
from tally.pipeline.runners import RunnerSpec


def make_runs(spool: Path, rows: int, manifest: tuple[np.ndarray, np.ndarray],
              hosts: int = 8, per_file: int = 100_000) -> None:
    """Runs "a" and "b": the same records for the first half of the steps, then others."""
    hashes, lengths = manifest
    steps = max(2, rows // (hosts * per_file))
    for run, seed in (("a", 1), ("b", 1)):
        for h in range(hosts):
            rng = np.random.default_rng(seed * 1000 + h)
            other = np.random.default_rng(7_000 + h)
            with LedgerWriter(spool, run, host=h, host_count=hosts, flush_every=1,
                              fsync=False) as w:
                for step in range(steps):
                    keys = rng.integers(0, len(hashes), per_file)
                    if run == "b" and step >= steps // 2:
                        keys = other.integers(0, len(hashes), per_file)
                    w.write_segments(step, Segments.build(
                        row=np.arange(per_file) % 1024, record_key=keys,
                        n_tokens=lengths[keys], content_hash=hashes[keys],
                        epoch=np.zeros(per_file)))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=20_000_000, help="rows per run")
    ap.add_argument("--records", type=int, default=5_000_000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--file-rows", type=int, default=100_000, help="rows per spool file")
    ap.add_argument("--mode", default="multi_processing",
                    help="FnApiRunner mode: multi_processing or in_memory")
    ap.add_argument("--dir", default="bench/out/diff")
    ap.add_argument("--keep", action="store_true", help="keep the data in --dir")
    args = ap.parse_args(argv)
    logging.getLogger().setLevel(logging.ERROR)  # Beam's workers log every start at INFO
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench.reference.posthoc_sql import reference

    out = Path(args.dir)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    try:
        t0 = time.perf_counter()
        man = make_manifest(out / "manifest.parquet", args.records)
        make_runs(out / "spool", args.rows, man, per_file=args.file_rows)
        with Ledger(out / "ledger.duckdb") as ledger:
            ingest(out / "spool", ledger)
            rows = int(ledger.query("SELECT count(*) AS n FROM consumption")[0]["n"])
        print(f"setup: {args.records:,}-record manifest, two runs, {rows:,} rows in all; "
              f"{time.perf_counter() - t0:.0f} s")

        t0 = time.perf_counter()
        with PeakRSS() as mem_ref:
            ref = reference((str(out / "ledger.duckdb"), "a"), (str(out / "ledger.duckdb"), "b"),
                            str(out / "manifest.parquet"), None, 1)
        ref_s = time.perf_counter() - t0
        print(f"DuckDB SQL reference: {ref_s:.1f} s = {rows / ref_s / 1e6:.2f} M rows/s, "
              f"{mem_ref.cpu:.0f} CPU s, peak RSS {mem_ref.peak / 2**30:.2f} GiB")

        t0 = time.perf_counter()
        with PeakRSS() as mem:
            d = diff(a=run_source(out / "spool", "a"), b=run_source(out / "spool", "b"),
                     manifest=out / "manifest.parquet", out=out / "diff", window=1,
                     runner=RunnerSpec("direct", mode=args.mode, workers=args.workers))
        beam_s = time.perf_counter() - t0
        same = (d["first_divergent_step"], d["identical_steps"], d["records"]) == (
            ref["first_divergent_step"], ref["identical_steps"], ref["records"])
        if not same:
            print(f"MISMATCH: Beam {d['first_divergent_step']} {d['identical_steps']} "
                  f"{d['records']}, SQL {ref['first_divergent_step']} {ref['identical_steps']} "
                  f"{ref['records']}")
        print(f"Beam diff, FnApiRunner {args.mode}: {beam_s:.1f} s = "
              f"{rows / beam_s / 1e6:.2f} M rows/s, {mem.cpu:.0f} CPU s, peak RSS "
              f"{mem.peak / 2**30:.2f} GiB; ratio to SQL reference {ref_s / beam_s:.2f} "
              f"(CPU s {mem_ref.cpu / max(mem.cpu, 1e-9):.2f}); first divergent step "
              f"{d['first_divergent_step']}, {d['identical_steps']} of {d['steps_compared']} "
              "steps identical")
        return {"rows": rows, "ref_s": ref_s, "beam_s": beam_s, "ratio": ref_s / beam_s,
                "peak": mem.peak, "cpu": mem.cpu, "same": same}
    finally:
        if not args.keep:  # large benchmarks clean up their data
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
