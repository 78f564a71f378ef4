"""Manifest job throughput on a >= 1 GB synthetic corpus.

Times the Beam manifest job (FnApiRunner in memory, FnApiRunner multi_processing, Dask on a
local cluster) and, as the reference in the same run, one plain Python process that reads every
shard and hashes every record with the same hash function and no Beam. Prints records/s, MB/s
and the ratio of each runner to the reference.

    python -m bench.manifest_rate [--records 540000] [--dir bench/out/manifest]
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from tally.audit.core.hashing import content_hash
from tally.pipeline.corpus import decode_record, list_shards
from tally.pipeline.manifest import build_manifest
from tally.pipeline.runners import RunnerSpec
from tally.pipeline.synth import synth_corpus


def plain(corpus: Path) -> int:
    from array_record.python.array_record_module import ArrayRecordReader

    n = 0
    for shard in list_shards(corpus):
        reader = ArrayRecordReader(str(shard.path))
        for start in range(0, shard.num_records, 20_000):
            for raw in reader.read(start, min(start + 20_000, shard.num_records)):
                content_hash(decode_record(raw, "")[0])
                n += 1
        reader.close()
    return n


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=540_000)
    ap.add_argument("--dir", default="bench/out/manifest")
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args(argv)
    logging.getLogger().setLevel(logging.ERROR)
    out = Path(args.dir)
    corpus = out / "corpus"
    if not (corpus / "corpus.json").exists():
        t0 = time.perf_counter()
        synth_corpus(corpus, records=args.records, seed=0, shards=8)
        print(f"synthesized {args.records:,} records in {time.perf_counter() - t0:.0f} s")
    size = sum(s.path.stat().st_size for s in list_shards(corpus))
    print(f"corpus: {size / 1e9:.2f} GB in {len(list_shards(corpus))} shards")

    t0 = time.perf_counter()
    n = plain(corpus)
    ref = time.perf_counter() - t0
    print(f"reference, one plain Python process: {n:,} records in {ref:.1f} s = "
          f"{n / ref:,.0f} records/s, {size / 1e6 / ref:,.0f} MB/s")
    res = {"records": n, "bytes": size, "reference_s": ref}
    runners = [("FnApiRunner in_memory", RunnerSpec("direct")),
               ("FnApiRunner multi_processing", RunnerSpec("direct", mode="multi_processing",
                                                           workers=args.workers)),
               ("Dask local cluster", RunnerSpec("dask", workers=args.workers))]
    for name, spec in runners:
        t0 = time.perf_counter()
        s = build_manifest(corpus, out / "manifest.parquet", runner=spec)
        dt = time.perf_counter() - t0
        assert s.records == n
        res[name] = dt
        print(f"{name}: {n / dt:,.0f} records/s, {size / 1e6 / dt:,.0f} MB/s, "
              f"ratio to reference {ref / dt:.2f}")
    return res


if __name__ == "__main__":
    main()
