"""What `tally serve`'s ingest rounds pay to list a spool of many files (issue 35).

A writer publishes two files (segments, metrics) a host every `flush_every` steps (100): the
seed run's ~1.4M steps from 128 hosts leave ~3.6M files in its spool, and the service lists
it every round. This builds `--hosts` host directories of `--files` publishes each (empty
files under spool names: a listing reads none of them) and a ledger that holds every one as
ingested, then times the service's own rounds (`IngestLoop.run_once`):

- a settled round (no directory changed: none is listed);
- a round after every directory changed (a publish of every host: each listed whole);
- a full listing (every FULL_LISTING_S: every directory listed, settled or not);
- the sweep's pass over every ingested file's stat (`SWEEP_FILES` a round).

Reference, in the same run: `os.listdir` of every host directory, what any listing of the
names pays. Also timed: stat-ing and parsing every file (`spool.scan` without the ingested
names), what the service's full listing did before.

    python -m bench.listing_rate [--hosts 128] [--files 2000] [--dir bench/out/listing]
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

import pyarrow as pa

from bench.serve_memory import rss_anon
from tally.audit.core import allocator
from tally.audit.hook import spool as sp
from tally.audit.ledger.database import Ledger
from tally.audit.ledger.ingest_loop import IngestLoop


def make(spool: Path, hosts: int, files: int) -> pa.Table:
    """The spool's empty files, and their `segments` rows as ingest would have written them."""
    cols: dict[str, list] = {c: [] for c in ("path", "kind", "host", "first_step", "mtime_ns")}
    for h in range(hosts):
        d = sp.host_dir(spool, "run", 0, h)
        d.mkdir(parents=True)
        for i in range(files):
            for kind in ("seg", "met"):
                name = sp.file_name(kind, i * 100, 0)
                (d / name).touch()
                cols["path"].append(f"run/attempt=0/host={h}/{name}")
                cols["kind"].append(kind)
                cols["host"].append(h)
                cols["first_step"].append(i * 100)
                cols["mtime_ns"].append((d / name).stat().st_mtime_ns)
    n = len(cols["path"])
    return pa.table({"file_id": pa.array(range(n), pa.int32()), **cols})


def timed(fn) -> tuple[float, float]:
    """(wall, CPU) seconds of fn()."""
    t, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t, time.process_time() - c


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=128)
    ap.add_argument("--files", type=int, default=2000, help="publishes a host (2 files each)")
    ap.add_argument("--dir", type=Path, default=Path("bench/out/listing"))
    args = ap.parse_args(argv)
    out = args.dir
    shutil.rmtree(out, ignore_errors=True)
    spool = out / "spool"
    t0 = time.perf_counter()
    rows = make(spool, args.hosts, args.files)
    n = rows.num_rows
    print(f"spool: {args.hosts} hosts x {2 * args.files:,} files = {n:,} files, made in "
          f"{time.perf_counter() - t0:.1f} s")
    dirs = [sp.host_dir(spool, "run", 0, h) for h in range(args.hosts)]
    res: dict[str, float] = {}
    try:
        with Ledger(out / "ledger.duckdb") as ledger:
            cur = ledger.cursor()
            run = ledger.ensure_run(cur, "run", "")
            ledger.ensure_attempt(cur, run, 0, None, args.hosts, "bench")
            cur.register("new", rows)
            cur.execute("""INSERT INTO segments (file_id, path, kind, run, attempt, host,
                first_step, last_step, n_rows, n_tokens, bytes, mtime_ns)
                SELECT file_id, path, kind, ?, 0, host, first_step, first_step + 99, 0, 0, 0,
                mtime_ns FROM new""", [run])
            cur.close()
            loop = IngestLoop(ledger, spool)
            allocator.release()
            before = rss_anon(os.getpid())
            res["first round (the ingested names from the ledger)"] = timed(loop.run_once)[1]
            allocator.release()
            per_file = (rss_anon(os.getpid()) - before) / n
            for _ in range(3):  # directories settle (SETTLE_S after their first listing)
                time.sleep(sp.SETTLE_S)
                loop.run_once()
            res["settled round"] = timed(loop.run_once)[1]
            for d in dirs:  # a publish of every host moves each directory's mtime
                os.utime(d)
            res["round after every directory changed"] = timed(loop.run_once)[1]
            loop._settling._full_at = float("-inf")
            res["full listing round"] = timed(loop.run_once)[1]
            swept, rounds, cpu = loop.swept, 0, 0.0
            loop._sweep_id = -1  # a pass from the first file (the rounds above began one)
            cur = ledger.cursor()
            while loop.swept - swept < n:
                loop._sweep_at -= sp.FULL_LISTING_S  # a pass's budget, unpaced
                cpu += timed(lambda: loop._sweep(cur))[1]
                rounds += 1
            cur.close()
            res["sweep, a round"] = cpu / rounds
            assert loop.quarantined == 0 and loop.rows == 0
        res["reference: os.listdir of every directory"] = timed(
            lambda: [os.listdir(d) for d in dirs])[1]
        res["before: stat and parse of every file"] = timed(
            lambda: sum(1 for _ in sp.scan(spool)))[1]
    finally:
        shutil.rmtree(out, ignore_errors=True)
    ref = res["reference: os.listdir of every directory"]
    for what, cpu in res.items():
        each = (f"{cpu / min(n, IngestLoop.SWEEP_FILES) * 1e6:.2f} us a stat"
                if what.startswith("sweep") else f"{cpu / n * 1e6:.2f} us a file")
        print(f"{what}: {cpu:.3f} CPU s, {each}, {cpu / ref:.2f}x the reference")
    print(f"sweep: {rounds} rounds of at most {IngestLoop.SWEEP_FILES:,} stats for a pass")
    print(f"the ingested names and stats the loop keeps: {per_file:.0f} bytes a file "
          "(anonymous memory after its first round)")
    return {"files": n, "cpu": res, "sweep_rounds": rounds, "bytes_a_file": per_file}


if __name__ == "__main__":
    main()
