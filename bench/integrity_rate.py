"""Integrity at ingest (issue 35 point 3): what checking each row against the manifest costs.

Writes a manifest of `--records` records and a spool of `--files` files of `--rows` rows whose
keys are uniform random over the records (the pages of the manifest cache they touch are as
scattered as they get) and whose hashes and lengths are the manifest's. Then times, in one run:
the cache's build (once per manifest), the check alone over the spool's tables in memory
(rows/s), and `ingest` of the spool into a fresh ledger without the check (the reference) and
with it; prints the ratio of the two ingest times. Cleans its data up.

    python -m bench.integrity_rate [--records 10000000] [--files 40] [--rows 250000]
                                   [--hosts 8] [--dir bench/out/integrity]
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tally.audit.hook import spool as sp
from tally.audit.hook.segments import Segments
from tally.audit.hook.writer import LedgerWriter
from tally.audit.ledger.database import Ledger
from tally.audit.ledger.ingest import ingest
from tally.audit.ledger.integrity import IngestIntegrity, segment_columns
from tally.pipeline.manifest_file import ROW_GROUP_RECORDS, ManifestKeyIndex, write_manifest_table


def make_manifest(path: Path, records: int, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    hashes = rng.integers(0, 2**63, records, dtype=np.int64).view(np.uint64)
    tokens = rng.integers(1, 8192, records).astype(np.int32)
    keys = np.arange(records)
    t = pa.table({"record_key": keys, "content_hash": hashes, "n_tokens": tokens,
                  "domain": pa.repeat("web", records), "split": pa.repeat("train", records),
                  "source": pa.repeat("s", records),
                  "source_index": keys})
    write_manifest_table(t, path, fingerprint="bench", row_group_size=ROW_GROUP_RECORDS)
    return hashes, tokens


def make_spool(spool: Path, files: int, rows: int, hosts: int, hashes: np.ndarray,
               tokens: np.ndarray, rng: np.random.Generator) -> None:
    for h in range(hosts):
        with LedgerWriter(spool, "bench", host=h, host_count=hosts, flush_every=1, fsync=False,
                          queue_size=4, manifest_fingerprint="bench") as w:
            for step in range(files // hosts):
                k = rng.integers(0, len(hashes), rows)
                w.write_segments(step, Segments.build(
                    row=np.arange(rows) % 512, record_key=k, offset=np.zeros(rows),
                    n_tokens=tokens[k], content_hash=hashes[k], epoch=np.zeros(rows)))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=10**7)
    ap.add_argument("--files", type=int, default=40)
    ap.add_argument("--rows", type=int, default=250_000)
    ap.add_argument("--hosts", type=int, default=8)
    ap.add_argument("--dir", default="bench/out/integrity")
    args = ap.parse_args(argv)
    out = Path(args.dir)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    try:
        return _measure(args, out)
    finally:
        shutil.rmtree(out, ignore_errors=True)  # GBs at the default size


def _measure(args: argparse.Namespace, out: Path) -> dict:
    rng = np.random.default_rng(0)
    manifest, spool = out / "manifest.parquet", out / "spool"
    hashes, tokens = make_manifest(manifest, args.records, rng)
    make_spool(spool, args.files, args.rows, args.hosts, hashes, tokens, rng)
    del hashes, tokens

    t0 = time.perf_counter()
    index = ManifestKeyIndex(manifest, out / "cache")
    build_s = time.perf_counter() - t0
    print(f"manifest cache: {args.records:,} records built in {build_s:.2f} s "
          f"({build_s / args.records * 1e9:.0f} ns a record, 12 bytes a record on disk)")

    tables = [pq.read_table(f.path) for f, _ in sp.scan(spool)]
    total = sum(t.num_rows for t in tables)
    check = IngestIntegrity(lambda: index)
    cols = [segment_columns(t) for t in tables]
    t0 = time.perf_counter()
    found = [check.check(index, c, "bench", None) for c in cols]
    check_s = time.perf_counter() - t0
    assert sum(f.hash_checked for f in found) == total and not any(
        f.hash_mismatches for f in found)
    del tables, cols
    print(f"check alone: {total:,} rows in {check_s:.2f} s = {total / check_s / 1e6:.2f} M "
          f"rows/s ({check_s / total * 1e9:.0f} ns a row)")

    times = {}
    for name, integrity in (("without", None), ("with", IngestIntegrity(lambda: index))):
        with Ledger(out / f"ledger-{name}.duckdb") as ledger:
            t0 = time.perf_counter()
            res = ingest(spool, ledger, integrity=integrity)
            ledger.con.execute("CHECKPOINT")
            times[name] = time.perf_counter() - t0
            assert res.rows == total and not res.quarantined
        print(f"ingest {name} the check: {total:,} rows in {times[name]:.2f} s = "
              f"{total / times[name] / 1e6:.2f} M rows/s")
    ratio = times["with"] / times["without"]
    print(f"ratio ingest time with / without the check: {ratio:.2f}")
    return {"rows": total, "records": args.records, "build_s": build_s,
            "check_rate": total / check_s, "ratio": ratio}


if __name__ == "__main__":
    main()
