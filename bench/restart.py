"""Restart time of `tally serve`: per-record state rebuilt from the ledger vs restored from its
snapshot (tally.audit.ledger.snapshot).

Writes a spool of `--rows` consumption rows through the real writer (bench.api_latency's
healthy loader over `--records` keys), ingests it with `tally ingest` (which writes the state
snapshot), then starts `tally serve` on the ledger three times, each in its own process, and
times each from the process's start to its first answer (`/v1/runs/RUN/coverage`, 200):

1. the reference: no snapshot (moved aside), so the service rebuilds the state from
   `effective_consumption`, as every start did before snapshots;
2. with the snapshot: validated, mapped, nothing to catch up;
3. with the snapshot behind the ledger by `--behind-rows` rows (ingested by a `tally ingest`
   that writes no snapshot): validated, mapped, those rows caught up.

Every start must answer exactly what the rebuilt one answered (3 against a rebuild of its own
ledger). Prints each time, the state load the service logged, and the ratio rebuild / restore.
Removes its data unless `--keep`.

    python -m bench.restart [--rows 30000000] [--records 10000000] [--dir bench/out/restart]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from bench.api_latency import RUN, Loader, write

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
ANSWERS = [f"/v1/runs/{RUN}/coverage", f"/v1/runs/{RUN}/hosts",
           f"/v1/runs/{RUN}/steps?points=50"]


def _tally(*args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tally.audit.cli", *args], cwd=ROOT,
                            env={**ENV, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _ingest(spool: Path, ledger: Path, env: dict | None = None) -> float:
    t0 = time.perf_counter()
    p = _tally("ingest", str(spool), "--ledger", str(ledger), "-q", env=env)
    out, _ = p.communicate()
    if p.returncode:
        raise RuntimeError(out)
    return time.perf_counter() - t0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_once(ledger: Path, records: int, label: str) -> dict:
    """Start `tally serve`, time its first answer, read the answers, stop it (SIGTERM: a clean
    stop, which writes a snapshot when one is due)."""
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    p = _tally("serve", "--ledger", str(ledger), "--records", str(records), "--port", str(port),
               "--log-level", "info")
    # Its output read as it comes: a pipe nobody reads fills (64 KiB), and the service then
    # blocks on its next log line (the 500M-row rebuild's progress did, for two minutes).
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(p.stdout), daemon=True)
    reader.start()
    try:
        while True:
            try:
                if httpx.get(base + ANSWERS[0], timeout=60).status_code == 200:
                    break
            except httpx.TransportError:
                if p.poll() is not None:
                    reader.join(60)
                    raise RuntimeError("".join(out)) from None
                time.sleep(0.05)
        first = time.perf_counter() - t0
        answers = {u: httpx.get(base + u, timeout=60).json() for u in ANSWERS}
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=600)
        reader.join(60)
    log = "".join(out)
    said = [s for s in log.splitlines() if "per-record state" in s]
    load = re.search(r" in ([0-9.]+) s", said[0]) if said else None
    print(f"{label:44s} first answer {first:6.1f} s; {said[0] if said else 'no state log'}")
    return {"first_answer_s": first, "state_load_s": float(load.group(1)) if load else None,
            "log": said, "answers": answers}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=30_000_000)
    ap.add_argument("--records", type=int, default=10_000_000)
    ap.add_argument("--hosts", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4096, help="segments per host and step")
    ap.add_argument("--flush-every", type=int, default=50)
    ap.add_argument("--behind-rows", type=int, default=2_000_000,
                    help="rows ingested after the snapshot for the catch-up start")
    ap.add_argument("--dir", default="bench/out/restart")
    ap.add_argument("--keep", action="store_true", help="keep the spool and ledger")
    args = ap.parse_args(argv)
    out = Path(args.dir)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    spool, ledger = out / "spool", out / "ledger.duckdb"
    snapshots, aside = out / "ledger.duckdb.state", out / "state.aside"
    loader = Loader(args.records, args.hosts, args.batch)
    try:
        per_step = args.hosts * args.batch
        steps = -(-args.rows // per_step)
        t0 = time.perf_counter()
        rows = write(spool, loader, range(steps), args.flush_every)
        print(f"spool: {rows:,} rows ({steps} steps x {args.hosts} hosts x {args.batch}) in "
              f"{time.perf_counter() - t0:.1f} s")
        print(f"tally ingest (writes the snapshot): {_ingest(spool, ledger):.1f} s")
        size = sum(f.stat().st_size for f in snapshots.iterdir())
        print(f"ledger {ledger.stat().st_size / 1e9:.2f} GB, snapshot {size / 1e9:.3f} GB "
              f"({args.records:,} records)")

        snapshots.rename(aside)  # the reference: no snapshot
        rebuilt = serve_once(ledger, args.records, "no snapshot (rebuild from the ledger):")
        assert "rebuilt from the ledger (no snapshot)" in rebuilt["log"][0], rebuilt["log"]
        shutil.rmtree(snapshots)  # the one its clean stop wrote; take the ingest's back
        aside.rename(snapshots)
        restored = serve_once(ledger, args.records, "snapshot, up to date:")
        assert "restored from its snapshot" in restored["log"][0], restored["log"]
        assert restored["answers"] == rebuilt["answers"]

        more = -(-args.behind_rows // per_step)
        behind = write(spool, loader, range(steps, steps + more), args.flush_every)
        _ingest(spool, ledger, env={"TALLY_SNAPSHOT_ROWS": str(10**18)})  # no new snapshot
        caught = serve_once(ledger, args.records, f"snapshot, {behind:,} rows behind:")
        assert f"and {behind:,} rows ingested after it" in caught["log"][0], caught["log"]
        shutil.rmtree(snapshots)
        again = serve_once(ledger, args.records, "no snapshot, same ledger (check):")
        assert caught["answers"] == again["answers"]
    finally:
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
    ratio = rebuilt["first_answer_s"] / restored["first_answer_s"]
    load_ratio = (rebuilt["state_load_s"] / max(restored["state_load_s"], 1e-3))
    print(f"ratio rebuild / restore, time to first answer: {ratio:.1f}; state load alone: "
          f"{rebuilt['state_load_s']:.2f} s vs {restored['state_load_s']:.2f} s "
          f"({load_ratio:.0f}x); caught up {behind:,} rows in {caught['state_load_s']:.2f} s")
    return {"rows": rows, "behind_rows": behind, "snapshot_bytes": size, "ratio": ratio,
            "rebuild": rebuilt["first_answer_s"], "restore": restored["first_answer_s"],
            "catch_up": caught["first_answer_s"], "rebuild_load": rebuilt["state_load_s"],
            "restore_load": restored["state_load_s"], "catch_up_load": caught["state_load_s"]}


if __name__ == "__main__":
    main()
