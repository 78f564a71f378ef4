"""`tally serve`'s anonymous memory a record while it ingests random keys (issue 35, point 6).

Starts `tally serve` (its own process, with the command line's allocator settings) over an
empty spool and reads its `RssAnon` (anonymous memory: not the page cache, not mapped files)
once it answers and has idled `--settle` seconds: the empty service. Then moves a spool of
`--rows` rows whose record keys are uniform random over `--records` records from `--hosts`
hosts (one file a host; the issue's shape: 2M rows over 20M records from 256 hosts) into the
spool it watches, waits until `/v1/runs` counts every row, lets it idle `--settle` seconds and
reads `RssAnon` again. Prints the bytes a record beyond the empty service, and their ratio to
the reference: the per-record state's own rows (`COMPACT`, 8 bytes a record), which no
implementation of the live answers can do without.

    python -m bench.serve_memory [--records 20000000] [--rows 2000000] [--hosts 256]
                                 [--settle 15] [--dir bench/out/serve_memory] [--keep]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import httpx

from bench.ingest_rate import make_spool
from bench.restart import _free_port, _tally
from tally.audit.ledger.state import COMPACT


def rss_anon(pid: int) -> int:
    """The process' anonymous resident memory, bytes (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc: Linux only")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=20_000_000)
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--hosts", type=int, default=256)
    ap.add_argument("--settle", type=float, default=15.0,
                    help="seconds idle before each reading")
    ap.add_argument("--dir", type=Path, default=Path("bench/out/serve_memory"))
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args(argv)
    out = args.dir
    shutil.rmtree(out, ignore_errors=True)
    (out / "spool").mkdir(parents=True)
    t0 = time.perf_counter()
    per_file = -(-args.rows // args.hosts)
    make_spool(out / "staged", args.hosts, per_file, args.hosts, args.records, "random")
    print(f"spool: {args.hosts} files of {per_file:,} rows, random keys over "
          f"{args.records:,} records, written in {time.perf_counter() - t0:.1f} s")
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    p = _tally("serve", "--ledger", str(out / "ledger.duckdb"), "--spool", str(out / "spool"),
               "--records", str(args.records), "--port", str(port), "-q")
    log: list[str] = []
    reader = threading.Thread(target=lambda: log.extend(p.stdout), daemon=True)
    reader.start()  # read as it comes: a full pipe would block the service
    try:
        runs = _wait(p, base, lambda r: r is not None, log)
        time.sleep(args.settle)
        empty = rss_anon(p.pid)
        for run in (out / "staged").iterdir():  # one rename: the files appear at once
            os.rename(run, out / "spool" / run.name)
        t0 = time.perf_counter()
        runs = _wait(p, base, lambda r: r and r[0]["exposures"] == per_file * args.hosts, log)
        took = time.perf_counter() - t0
        time.sleep(args.settle)
        full = rss_anon(p.pid)
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=600)
        reader.join(60)
    per_record = (full - empty) / args.records
    state = COMPACT.itemsize
    print(f"ingested {runs[0]['exposures']:,} rows in {took:.1f} s (as the service polls)")
    print(f"RssAnon: empty service {empty / 2**20:.0f} MiB, after the rows {full / 2**20:.0f} MiB:"
          f" {per_record:.1f} bytes a record beyond the empty service")
    print(f"reference: the per-record state's rows, {state} bytes a record; ratio "
          f"{per_record / state:.2f} (the issue's goal: <= 12 bytes, 1.5)")
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)
    return {"empty": empty, "full": full, "per_record": per_record, "ratio": per_record / state}


def _wait(p, base: str, done, log: list[str], timeout: float = 1800.0):
    """`/v1/runs` polled until `done(runs)` (runs None until the service answers)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            runs = httpx.get(base + "/v1/runs", timeout=60).json()
        except httpx.TransportError:
            runs = None
            if p.poll() is not None:
                raise RuntimeError("tally serve exited:\n" + "".join(log)) from None
        if done(runs):
            return runs
        if time.monotonic() > deadline:
            raise RuntimeError(f"tally serve did not get there in {timeout:.0f} s: {runs}")
        time.sleep(0.2)


if __name__ == "__main__":
    main()
