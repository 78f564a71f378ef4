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

Where the CPU went: the ingest's user and system seconds and minor page faults, the process's
and each thread's (Linux; threads by their Python names, read from /proc every 0.2 s), beside
the reference's. System time is the clue to allocation churn: on this VM a page the process has
not touched before (or gave back) costs ~25 us, so memory freed and faulted in again each batch
shows there, and not in the rows' count (issue 35).

`--scale K` is the regression guard for that growth: the same rows are ingested twice, over
`--records` and over K times as many records, each beside its own reference, and the command
exits non-zero when the ingest's ratio to its reference over K times the records falls below
`--min-scaling` of that over `--records` (the reference does not depend on the records, so
the box's load between the two runs cancels).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import sys
import threading
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


class ThreadCPU:
    """User and system seconds and minor faults of this process and of each of its threads over
    a `with` block, from getrusage and /proc/self/task (Linux; elsewhere the process's only).
    Threads are sampled every `every` seconds and at the end: a thread that ends between
    samples loses at most that much of its account."""

    def __init__(self, every: float = 0.2) -> None:
        self.every = every
        self.threads: dict[int, tuple[str, float, float, int]] = {}
        self._stop = threading.Event()

    def __enter__(self) -> ThreadCPU:
        self._base = self._sample()
        self._r0 = resource.getrusage(resource.RUSAGE_SELF)
        self._watch = threading.Thread(target=self._run, daemon=True, name="bench-cpu")
        self._watch.start()
        return self

    def __exit__(self, *exc: object) -> None:
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        self._stop.set()
        self._watch.join()
        self._keep(self._sample())
        self.user = r1.ru_utime - self._r0.ru_utime
        self.sys = r1.ru_stime - self._r0.ru_stime
        self.faults = r1.ru_minflt - self._r0.ru_minflt

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self._keep(self._sample())

    def _keep(self, now: dict[int, tuple[str, float, float, int]]) -> None:
        for tid, (name, user, sys_s, flt) in now.items():
            _, u0, s0, f0 = self._base.get(tid, (name, 0.0, 0.0, 0))
            self.threads[tid] = (name, user - u0, sys_s - s0, flt - f0)

    @staticmethod
    def _sample() -> dict[int, tuple[str, float, float, int]]:
        names = {t.native_id: t.name for t in threading.enumerate()}
        tick = os.sysconf("SC_CLK_TCK")
        out = {}
        try:
            tids = os.listdir("/proc/self/task")
        except OSError:  # not Linux: the process's figures only
            return out
        for tid in tids:
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:  # ended meanwhile
                continue
            # After the name: state is field 3 of stat(5); minflt 10, utime 14, stime 15.
            out[int(tid)] = (names.get(int(tid), "(native)"), int(fields[11]) / tick,
                             int(fields[12]) / tick, int(fields[7]))
        return out

    def by_name(self) -> dict[str, tuple[float, float, int]]:
        """User s, system s and faults of the Python threads, summed by name (a pool's thread
        of the same name may have come and gone more than once)."""
        out: dict[str, tuple[float, float, int]] = {}
        for name, user, sys_s, flt in self.threads.values():
            if name not in ("(native)", "bench-cpu"):
                u, s, f = out.get(name, (0.0, 0.0, 0))
                out[name] = (u + user, s + sys_s, f + flt)
        return out

    def report(self, title: str) -> str:
        lines = [f"{title}: {self.user:.1f} user + {self.sys:.1f} system CPU s, "
                 f"{self.faults:,} minor faults"]
        busy = sorted(self.threads.values(), key=lambda t: -(t[1] + t[2]))
        native = [t for t in busy if t[0] in ("(native)", "bench-cpu")]
        for name, user, sys_s, flt in [t for t in busy if t not in native][:6]:
            if user + sys_s >= 0.05:
                lines.append(f"  {name:<24} {user:6.1f} user {sys_s:6.1f} system "
                             f"{flt:>10,} faults")
        if native:  # DuckDB's and Arrow's own threads (and this sampler), together
            lines.append(f"  {'other (native) threads':<24} {sum(t[1] for t in native):6.1f} "
                         f"user {sum(t[2] for t in native):6.1f} system "
                         f"{sum(t[3] for t in native):>10,} faults")
        return "\n".join(lines)


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

    with ThreadCPU() as ref_cpu:
        ref_s = reference(tables, out / "reference.duckdb")
    del tables
    with Ledger(out / "ledger.duckdb") as ledger, ThreadCPU() as ours_cpu:
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
    print(ref_cpu.report("the reference's CPU"))
    print(ours_cpu.report("the ingest's CPU"))
    shutil.rmtree(out, ignore_errors=True)  # a large run's spool and ledgers: GBs
    return {"rows": total, "ref_rate": ref_rate, "ours_rate": ours_rate,
            "ratio": ours_rate / ref_rate, "ref_sys_s": ref_cpu.sys, "sys_s": ours_cpu.sys,
            "threads": ours_cpu.by_name()}


if __name__ == "__main__":
    main()
