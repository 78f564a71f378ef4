"""Ingest rate: `tally.audit.ledger.ingest` against a bare DuckDB `INSERT ... SELECT` of the same
tables.

Writes a spool of `--files` segment files of `--rows` rows each through the real writer, then
times (a) ingest of the spool into a fresh ledger (footer, schema, metadata and value checks;
batches of about two million rows per transaction with their `segments` rows, `host_steps`
and the live API's aggregates over random keys of 10M records) and (b) the
reference: the same Arrow tables, already in memory, inserted into a fresh DuckDB file with one
`INSERT ... SELECT` each. Prints both rates and their ratio.

The key shape matters to the per-record state (issue 35): `--keys random` (default) draws each
row's record uniformly over `--records` (a per-host-seed loader, the reference incident),
`--keys perm` takes consecutive slices of one permutation (a correct loader). With many rows a
step (`--hosts` x `--rows` larger than the state's pending bound) the cost per row once grew
with the number of records: 16 hosts x 13 steps x 500k rows over 100M records ingested at
133k rows/s.

    python -m bench.ingest_rate [--files 200] [--rows 100000] [--hosts 8] [--records 10000000]
                                [--keys random|perm] [--dir bench/out/ingest]
                                [--scale 4 [--min-scaling 0.8]]

`--scale K` is the regression guard for that growth: the same rows are ingested twice, over
`--records` and over K times as many records, each beside its own reference, and the command
exits non-zero when the ingest's ratio to its reference over K times the records falls below
`--min-scaling` of that over `--records` (the reference does not depend on the records, so
the box's load between the two runs cancels).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import duckdb
import numpy as np
import pyarrow.parquet as pq

from tally.audit.core import allocator
from tally.audit.hook import spool as sp
from tally.audit.hook.segments import Segments
from tally.audit.hook.writer import LedgerWriter
from tally.audit.ledger.database import Ledger
from tally.audit.ledger.ingest import ingest


def make_spool(spool: Path, files: int, rows: int, hosts: int = 8, records: int = 10**7,
               keys: str = "random") -> None:
    rng = np.random.default_rng(0)
    per_host = files // hosts
    perm = rng.permutation(records) if keys == "perm" else None
    for h in range(hosts):
        with LedgerWriter(spool, "bench", host=h, host_count=hosts, flush_every=1, fsync=False,
                          queue_size=4, records_per_epoch=records) as w:
            for step in range(per_host):
                if perm is None:
                    k = rng.integers(0, records, rows)
                else:
                    k = perm[np.arange((step * hosts + h) * rows,
                                       (step * hosts + h + 1) * rows) % records]
                w.write_segments(step, Segments.build(
                    row=np.arange(rows) % 512, record_key=k,
                    offset=np.zeros(rows), n_tokens=rng.integers(1, 8192, rows),
                    content_hash=rng.integers(0, 2**63, rows, dtype=np.int64).view(np.uint64),
                    epoch=np.zeros(rows)))


def reference(tables: list, path: Path) -> float:
    con = duckdb.connect(str(path))
    con.execute('CREATE TABLE consumption (step BIGINT, host INTEGER, "row" INTEGER, '
                'record_key BIGINT, "offset" INTEGER, n_tokens INTEGER, content_hash UBIGINT, '
                'epoch INTEGER)')
    t0 = time.perf_counter()
    for t in tables:
        con.register("incoming", t)
        con.execute("INSERT INTO consumption SELECT * FROM incoming")
        con.unregister("incoming")
    con.execute("CHECKPOINT")
    dt = time.perf_counter() - t0
    con.close()
    return dt


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=200)
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--hosts", type=int, default=8)
    ap.add_argument("--records", type=int, default=10**7)
    ap.add_argument("--keys", choices=("random", "perm"), default="random")
    ap.add_argument("--dir", default="bench/out/ingest")
    ap.add_argument("--scale", type=int, default=0,
                    help="also ingest the same rows over SCALE times the records, and compare")
    ap.add_argument("--min-scaling", type=float, default=0.8,
                    help="with --scale: the least rate over SCALE x records / rate over records")
    args = ap.parse_args(argv)
    allocator.tune()  # as `tally ingest` runs (its command line tunes glibc's malloc first)
    res = _measure(args, args.records)
    if not args.scale:
        return res
    big = _measure(args, args.scale * args.records)
    # Each rate against its own reference: the box's load between the two runs cancels
    # (the reference's cost does not depend on the records).
    scaling = big["ratio"] / res["ratio"]
    print(f"scaling: ingest/reference over {args.scale}x the records / over {args.records:,} "
          f"records: {scaling:.2f} (raw rates {big['ours_rate'] / res['ours_rate']:.2f}; "
          f"guard >= {args.min_scaling})")
    out = {**res, "scaled": big, "scaling": scaling}
    if scaling < args.min_scaling:
        print(f"FAIL: the ingest's cost per row grows with the number of records "
              f"({scaling:.2f} < {args.min_scaling})", file=sys.stderr)
        sys.exit(1)
    return out


def _measure(args: argparse.Namespace, records: int) -> dict:
    """One spool of `records` records, ingested beside the reference; the figures."""
    out = Path(args.dir)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    spool = out / "spool"
    t0 = time.perf_counter()
    make_spool(spool, args.files, args.rows, args.hosts, records, args.keys)
    print(f"spool: {args.files} files x {args.rows:,} rows ({args.hosts} hosts, {args.keys} "
          f"keys over {records:,} records) written in "
          f"{time.perf_counter() - t0:.1f} s")
    paths = [f.path for f, _ in sp.scan(spool)]
    tables = [pq.read_table(p) for p in paths]
    total = sum(t.num_rows for t in tables)

    ref_s = reference(tables, out / "reference.duckdb")
    del tables
    with Ledger(out / "ledger.duckdb") as ledger:
        t0 = time.perf_counter()
        res = ingest(spool, ledger)
        ledger.con.execute("CHECKPOINT")
        ours_s = time.perf_counter() - t0
        assert res.rows == total and not res.quarantined
    ref_rate, ours_rate = total / ref_s, total / ours_s
    print(f"reference INSERT ... SELECT of in-memory Arrow tables: {total:,} rows in "
          f"{ref_s:.2f} s = {ref_rate / 1e6:.2f} M rows/s")
    print(f"tally ingest from Parquet files (checked, aggregates, ~2M rows per transaction): "
          f"{total:,} rows "
          f"in {ours_s:.2f} s = {ours_rate / 1e6:.2f} M rows/s")
    print(f"ratio ingest / reference: {ours_rate / ref_rate:.2f} (target >= 0.5)")
    shutil.rmtree(out, ignore_errors=True)  # a large run's spool and ledgers: GBs
    return {"rows": total, "ref_rate": ref_rate, "ours_rate": ours_rate,
            "ratio": ours_rate / ref_rate}


if __name__ == "__main__":
    main()
