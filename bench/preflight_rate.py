"""Pre-flight rate: `run_preflight` on a reshard against the bare loader iteration it contains.

Setup (not timed): a manifest of `--records` train records (log-normal lengths, written
directly: the shadow run needs only keys and lengths), an old topology of `--old-hosts` hosts
on the elastic keyed loader that consumed `--old-steps` steps through the real writer into a
real ledger, and a real orbax checkpoint of their loader states.

Timed, for `--hosts` new hosts x `--steps` steps x `--rows` rows per host:
(a) reference: the bare loop, in one process: every new host's KeyedLoader (same builder, same
    shadow source) restored from its state and stepped `--steps` times, nothing else;
(b) `run_preflight` in one process (workers=1): the same iteration plus record extraction,
    checkpoint and manifest reading, ledger queries and the checks;
(c) `run_preflight` with `--workers` processes (default: one per core).
Prints the times and the ratios (b)/(a) and (c)/(a); (b) and (c) must give the same verdict.

    python -m bench.preflight_rate [--hosts 64] [--steps 1000] [--rows 8] [--workers N]
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from tally.audit.hook.writer import LedgerWriter
from tally.audit.ledger.database import Ledger
from tally.audit.ledger.ingest import ingest
from tally.audit.preflight import load_checkpoint_meta, run_preflight
from tally.pipeline.loader import KeyedLoader, LoaderConfig, state_for_host
from tally.pipeline.manifest import MANIFEST_SCHEMA
from tally.pipeline.manifest_file import write_manifest_table
from tally.pipeline.shadow import ShadowSource


def write_manifest(path: Path, records: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(400), 1.0, records), 1, 8192).astype(np.int32)
    table = pa.Table.from_pydict({
        "record_key": np.arange(records, dtype=np.int64),
        "content_hash": rng.integers(0, 2**63, records, dtype=np.int64).view(np.uint64),
        "n_tokens": lengths, "domain": ["web"] * records, "split": ["train"] * records,
        "source": ["bench.array_record"] * records,
        "source_index": np.arange(records, dtype=np.int64),
        "doc_id": pa.nulls(records, pa.string())}, schema=MANIFEST_SCHEMA)
    write_manifest_table(table, path)
    return lengths


def old_run(out: Path, source: ShadowSource, cfg: LoaderConfig, hosts: int, steps: int) -> Path:
    from tally.trainer import checkpoint

    states = {}
    for h in range(hosts):
        loader = KeyedLoader(source, cfg, h, hosts)
        with LedgerWriter(out / "spool", "bench", host=h, host_count=hosts, fsync=False,
                          records_per_epoch=len(source), flush_every=steps) as w:
            for step in range(steps):
                w.write_batch(step, next(loader))
        states[str(h)] = loader.get_state()
    with Ledger(out / "ledger.duckdb") as ledger:
        ingest(out / "spool", ledger)
    checkpoint.save(checkpoint.manager(out / "ckpt"), steps, {"w": np.zeros(1, np.float32)},
                    {"mu": np.zeros(1, np.float32)},
                    {"step": steps, "attempt": 0, "loaders": states})
    return out / "ckpt"


def bare(source: ShadowSource, cfg: LoaderConfig, hosts: int, steps: int, loaders: dict) -> int:
    rows = 0
    for h in range(hosts):
        loader = KeyedLoader(source, cfg, h, hosts)
        loader.set_state(state_for_host(loaders, h))
        for _ in range(steps):
            rows += len(next(loader)["key"])
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=64)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--rows", type=int, default=8, help="rows per host per step")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--packing", default="none", choices=["none", "first_fit", "concat_split"],
                    help="none: the elastic iterator (a reshard); packed: the per-host "
                         "iterator on an unchanged topology (--old-hosts is ignored)")
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--old-hosts", type=int, default=32)
    ap.add_argument("--old-steps", type=int, default=50)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--dir", default="bench/out/preflight")
    args = ap.parse_args(argv)
    out = Path(args.dir)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)

    t0 = time.perf_counter()
    write_manifest(out / "m.parquet", args.records)
    source = ShadowSource.from_manifest(out / "m.parquet")
    batch = args.hosts * args.rows
    elastic = args.packing == "none"
    old_hosts = args.old_hosts if elastic else args.hosts
    cfg = LoaderConfig(seq_len=args.seq_len, global_batch=batch, packing=args.packing,
                       elastic=elastic, read_threads=0, read_buffer=0)
    if elastic:  # the old topology's batch: its hosts' rows add up to the same global batch
        assert batch % old_hosts == 0, "--old-hosts must divide the global batch"
    ckpt = old_run(out, source, cfg, old_hosts, args.old_steps)
    print(f"setup: {args.records:,}-record manifest, {old_hosts} old hosts x "
          f"{args.old_steps} steps into the ledger, checkpoint: {time.perf_counter() - t0:.1f} s")

    t0 = time.perf_counter()
    rows = bare(source, cfg, args.hosts, args.steps, load_checkpoint_meta(ckpt)["loaders"])
    ref_s = time.perf_counter() - t0
    assert rows == args.hosts * args.steps * args.rows
    print(f"(a) reference, bare loader iteration (1 process, packing {args.packing}): "
          f"{rows:,} rows in {ref_s:.1f} s")

    res = {"rows": rows, "ref_s": ref_s}
    verdicts = []
    for label, workers in (("b", 1), ("c", args.workers)):
        t0 = time.perf_counter()
        v = run_preflight(out / "ledger.duckdb", "bench", out / "m.parquet", ckpt, args.hosts,
                          horizon=args.steps, workers=workers)
        dt = time.perf_counter() - t0
        assert v.status == "safe" and v.numbers["horizon_steps"] == args.steps, v.summary()
        verdicts.append({k: x for k, x in v.numbers.items() if k not in ("seconds", "workers")})
        res[f"{label}_s"], res[f"{label}_ratio"] = dt, dt / ref_s
        print(f"({label}) run_preflight, {workers} process(es): {dt:.1f} s, "
              f"ratio to reference {dt / ref_s:.2f}")
    assert verdicts[0] == verdicts[1], "the worker processes planned differently"
    print(f"verdict: {v.headline()}; {v.numbers['planned']:,} record starts planned "
          f"(target: < 60 s for 64 hosts x 1000 steps x 8 rows)")
    res["planned"] = v.numbers["planned"]
    return res


if __name__ == "__main__":
    main()
