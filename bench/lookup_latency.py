"""Record lookup latency with the lookup index (tally.audit.ledger.lookup) against a scan.

Writes `--rows` consumption rows through the real writer (bench.api_latency's healthy loader),
ingests them (which builds the index as it goes), then times `--lookups` lookups by record key
and by content hash through `tally.audit.ledger.queries.record`, with the index and with a scan of
`consumption` (the reference, in the same run). Also times building the whole index from the
ledger at once (what an existing ledger costs on its first start) and reports its size.

    python -m bench.lookup_latency [--rows 20000000] [--records 5000000] [--dir bench/out/lookup]
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import numpy as np

from bench.api_latency import Loader, write
from tally.audit.ledger import lookup
from tally.audit.ledger import queries as q
from tally.audit.ledger.database import Ledger
from tally.audit.ledger.ingest import ingest
from tally.audit.ledger.lookup import LookupIndex


def _times(cur, kind: str, values: list[int], index: LookupIndex | None) -> np.ndarray:
    out = []
    for v in values:
        t0 = time.perf_counter()
        q.record(cur, 1, **{"record_key" if kind == "key" else "content_hash": v},
                 index=index)
        out.append(time.perf_counter() - t0)
    return np.array(out) * 1e3


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=20_000_000)
    ap.add_argument("--records", type=int, default=5_000_000)
    ap.add_argument("--hosts", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4096, help="segments per host and step")
    ap.add_argument("--lookups", type=int, default=200, help="per kind and method")
    ap.add_argument("--dir", default="bench/out/lookup")
    ap.add_argument("--keep", action="store_true", help="keep the spool and ledger")
    args = ap.parse_args(argv)
    out = Path(args.dir)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    spool, path = out / "spool", out / "ledger.duckdb"
    loader = Loader(args.records, args.hosts, args.batch)
    steps = -(-args.rows // (args.hosts * args.batch))
    try:
        rows = write(spool, loader, range(steps), 50)
        with Ledger(path) as ledger:
            t0 = time.perf_counter()
            ingest(spool, ledger)
            ingest_s = time.perf_counter() - t0
            index = lookup.for_ledger(ledger)
            runs = len(index.coverage.runs["key"])
            size = index.size_bytes()
            cur = ledger.cursor()
            rng = np.random.default_rng(0)
            keys = rng.integers(0, args.records, args.lookups).tolist()
            hashes = [int(k) * 0x9E3779B97F4A7C15 % 2**64 for k in keys]  # the loader's hash
            result = {"rows": rows, "ingest_s": ingest_s, "runs": runs, "index_bytes": size}
            for kind, values in (("key", keys), ("hash", hashes)):
                scan = _times(cur, kind, values, None)
                fast = _times(cur, kind, values, index)
                result[kind] = {"scan_p50": float(np.percentile(scan, 50)),
                                "scan_p99": float(np.percentile(scan, 99)),
                                "index_p50": float(np.percentile(fast, 50)),
                                "index_p99": float(np.percentile(fast, 99))}
            # The whole index at once, from the ledger (an existing ledger's first start).
            shutil.rmtree(index.dir, ignore_errors=True)  # runs below MEMORY_ROWS: none on disk
            fresh = LookupIndex(index.dir, index.owner)
            t0 = time.perf_counter()
            while fresh.catch_up(cur):
                pass
            result["build_s"] = time.perf_counter() - t0
            cur.close()
    finally:
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
    print(f"{rows:,} rows ingested in {ingest_s:.1f} s (index built as it went); index "
          f"{result['index_bytes'] / 2**20:,.0f} MiB in {runs} runs per kind; built at once in "
          f"{result['build_s']:.1f} s ({rows / result['build_s'] / 1e6:.2f} M rows/s)")
    for kind in ("key", "hash"):
        r = result[kind]
        print(f"lookup by {kind}: index p50 {r['index_p50']:.1f} ms p99 {r['index_p99']:.1f} ms;"
              f" scan p50 {r['scan_p50']:.1f} ms p99 {r['scan_p99']:.1f} ms; ratio (scan / "
              f"index) p99 {r['scan_p99'] / r['index_p99']:.1f}x")
    return result


if __name__ == "__main__":
    main()
