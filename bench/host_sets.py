"""Cost of the live host answer on more hosts than the per-record state tracks (64).

Writes a spool of `--rows` consumption rows on `--hosts` hosts through the real writer, each
host sampling `--records` keys with replacement from its own seed (the per-host-seed fault:
records land on several hosts), ingests it, then times, on the one ledger:

1. the reference: the 64-host path, reading the agg tables kept at ingest (`agg_host_pairs`,
   `agg_hosts`: what /hosts costs up to 64 hosts);
2. the least SQL any exact answer needs: DuckDB's distinct (record, host) pairs of the
   effective record starts, counted per host (no matrix);
3. `queries.host_sets`: the on-demand pass that /hosts, the summary and /metrics share beyond
   64 hosts (per-host unique, shared, the full overlap matrix, records on 2+ hosts), and the
   whole /hosts answer with it.

Checks the on-demand answer against the SQL per-host counts. Prints each time (median of
`--repeats`), the on-demand peak of numpy memory (tracemalloc) and the ratios. Removes its data
unless `--keep`.

    python -m bench.host_sets [--rows 16000000] [--records 4000000] [--hosts 128]
"""

from __future__ import annotations

import argparse
import shutil
import time
import tracemalloc
from pathlib import Path

import numpy as np

from audit.hook.segments import Segments
from audit.hook.writer import LedgerWriter
from audit.ledger import queries as q
from audit.ledger.database import Ledger
from audit.ledger.ingest import ingest

RUN = "hosts"


def write(spool: Path, rows: int, records: int, hosts: int, batch: int) -> int:
    steps = -(-rows // (hosts * batch))
    for h in range(hosts):  # one host at a time: one writer thread at a time
        rng = np.random.default_rng(h)
        with LedgerWriter(spool, RUN, host=h, host_count=hosts, flush_every=steps,
                          fsync=False, records_per_epoch=records) as w:
            for step in range(steps):
                keys = rng.integers(0, records, batch)
                w.write_segments(step, Segments.build(
                    row=np.arange(batch), record_key=keys, n_tokens=np.full(batch, 512),
                    content_hash=keys.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15),
                    epoch=np.zeros(batch, np.int64)))
    return steps * hosts * batch


def _median(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16_000_000)
    ap.add_argument("--records", type=int, default=4_000_000)
    ap.add_argument("--hosts", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1000, help="rows a host consumes per step")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default="bench/out/host_sets")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args(argv)
    out = Path(args.dir)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    try:
        t0 = time.perf_counter()
        rows = write(out / "spool", args.rows, args.records, args.hosts, args.batch)
        print(f"spool: {rows:,} rows on {args.hosts} hosts in {time.perf_counter() - t0:.1f} s")
        with Ledger(out / "ledger.duckdb") as ledger:
            t0 = time.perf_counter()
            assert not ingest(out / "spool", ledger).quarantined
            print(f"ingest: {time.perf_counter() - t0:.1f} s")
            cur = ledger.cursor()
            cur.execute("BEGIN TRANSACTION")
            run = q.run_of(cur, RUN)
            ref_s, _ = _median(lambda: (
                cur.execute("SELECT a, b, records FROM agg_host_pairs WHERE run = ? AND "
                            "records <> 0", [run]).fetchall(),
                cur.execute("SELECT host, shared FROM agg_hosts WHERE run = ?",
                            [run]).fetchall()), args.repeats)
            sql_s, per_host = _median(lambda: dict(cur.execute("""
                WITH seen AS (SELECT DISTINCT record_key, host FROM effective_consumption
                              WHERE run = ? AND "offset" = 0)
                SELECT host, count(*) FROM seen GROUP BY host""", [run]).fetchall()),
                                      args.repeats)
            tracemalloc.start()
            sets_s, sets = _median(lambda: q.host_sets(cur, run, args.hosts), args.repeats)
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            answer_s, answer = _median(lambda: q.hosts(cur, run), args.repeats)
            cur.execute("ROLLBACK")
            cur.close()
        assert [per_host.get(h, 0) for h in range(args.hosts)] == np.diag(sets.overlap).tolist()
        assert [p["unique"] for p in answer["per_host"]] == np.diag(sets.overlap).tolist()
        pairs = sum(per_host.values())
        res = {"rows": rows, "hosts": args.hosts, "pairs": pairs, "reference_s": ref_s,
               "sql_s": sql_s, "host_sets_s": sets_s, "answer_s": answer_s,
               "numpy_peak_mb": peak / 2**20, "multi_host_records": sets.multi_host_records,
               "ratio_to_sql": sets_s / sql_s, "ratio_to_reference": sets_s / max(ref_s, 1e-9)}
        print(f"distinct (record, host) pairs: {pairs:,}; records on 2+ hosts: "
              f"{sets.multi_host_records:,}")
        print(f"reference, the 64-host path (agg tables): {ref_s * 1e3:.1f} ms")
        print(f"SQL, distinct pairs counted per host (no matrix): {sql_s:.2f} s")
        print(f"on demand, queries.host_sets (unique, shared, matrix, 2+ hosts): {sets_s:.2f} s "
              f"({rows / sets_s / 1e6:.1f} M rows/s; numpy peak {peak / 2**20:.0f} MiB)")
        print(f"whole /hosts answer with it: {answer_s:.2f} s")
        print(f"ratio on demand / SQL: {res['ratio_to_sql']:.2f}; on demand / agg tables: "
              f"{res['ratio_to_reference']:.0f}")
        return res
    finally:
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
