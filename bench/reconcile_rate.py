"""Reconcile throughput and memory: the Beam job against one DuckDB query.

Builds a manifest of `--records` records and a spool of `--rows` consumption rows (8 hosts,
100,000-row segment files, keys drawn uniformly, so every record is seen ~rows/records times),
then times (a) the reference: by default the issue's, one DuckDB query over the same spool and
manifest computing the exposure histogram, never-seen records, hash mismatches and records on
2+ hosts (`spool_query`); with `--reference sql` (or `both`) also the SQL oracle of every number
over a ledger the spool is ingested into (bench/reference/reconcile_sql.py, one query each,
much slower); and (b) `tally reconcile --spool` on FnApiRunner (in memory, the command line's
default, unless `--mode` says otherwise), sampling the peak resident memory and the CPU seconds
of the whole process tree (on a shared machine CPU seconds vary less than wall time). The ratio
is the reference's time over reconcile's; the report's numbers are asserted equal to the
reference's. The process tunes glibc's malloc as the command line does.

    python -m bench.reconcile_rate [--rows 50000000] [--records 10000000]
        [--mode in_memory[,multi_processing]] [--repeats 1] [--reuse]
        [--reference query|sql|both] [--dir bench/out/reconcile]
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import threading
import time
from pathlib import Path

import duckdb
import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq

from tally.audit.core import allocator
from tally.audit.hook.segments import Segments
from tally.audit.hook.writer import LedgerWriter
from tally.audit.ledger.database import Ledger
from tally.audit.ledger.ingest import ingest
from tally.audit.reconcile import reconcile
from tally.pipeline.manifest import MANIFEST_SCHEMA, ROW_GROUP_RECORDS
from tally.pipeline.manifest_file import write_manifest_table
from tally.pipeline.runners import RunnerSpec

DOMAINS = np.array(["web", "code", "wiki", "books"])


def make_manifest(path: Path, n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    hashes = rng.integers(0, 2**63, n).astype(np.uint64)
    lengths = rng.integers(16, 4096, n).astype(np.int32)
    t = pa.table({
        "record_key": np.arange(n, dtype=np.int64), "content_hash": hashes,
        "n_tokens": lengths,
        "domain": pa.array(DOMAINS[rng.integers(0, 4, n)]),
        "split": pa.array(np.full(n, "train")),
        "source": pa.array(np.char.add("train-", (np.arange(n) // 500_000).astype(str))),
        "source_index": np.arange(n, dtype=np.int64) % 500_000,
        "doc_id": pa.nulls(n, pa.string()),
    }, schema=MANIFEST_SCHEMA)
    write_manifest_table(t, path, row_group_size=ROW_GROUP_RECORDS)
    return hashes, lengths


def make_spool(spool: Path, rows: int, manifest: tuple[np.ndarray, np.ndarray],
               hosts: int = 8, per_file: int = 100_000) -> None:
    hashes, lengths = manifest
    rng = np.random.default_rng(1)
    steps = rows // (hosts * per_file)
    for h in range(hosts):
        with LedgerWriter(spool, "bench", host=h, host_count=hosts, flush_every=1,
                          fsync=False) as w:
            for step in range(steps):
                keys = rng.integers(0, len(hashes), per_file)
                w.write_segments(step, Segments.build(
                    row=np.arange(per_file) % 1024, record_key=keys,
                    n_tokens=lengths[keys], content_hash=hashes[keys],
                    epoch=np.zeros(per_file)))


def spool_query(spool: Path, run_id: str, manifest: Path, tmp: Path) -> dict:
    """The issue's reconcile reference: one DuckDB query over the run's spool files and the
    manifest computing the exposure histogram (0, 1, 2, 3+; 0 is never seen), the hash
    mismatches and the records seen by 2+ hosts (with their (record, host) pairs, what the
    report's per-host `overlap_with_others` sums to). Every segment file counts: it is for a
    spool of one attempt, where every row is effective (seed_scale's); the oracle with
    rollbacks is bench/reference/reconcile_sql.py. DuckDB's own defaults (threads, 80% of the
    memory), spilling under `tmp`."""
    files = str(Path(spool) / run_id / "attempt=*" / "host=*" / "seg-*.parquet")
    con = duckdb.connect(config={"temp_directory": str(tmp)})
    try:
        row = con.execute(f"""
            WITH starts AS (
                SELECT record_key, host, n_tokens, content_hash
                FROM read_parquet('{files}', hive_partitioning = false) WHERE "offset" = 0),
            per AS (
                SELECT count(s.record_key) AS e, count(DISTINCT s.host) AS hosts,
                    count(*) FILTER (WHERE s.n_tokens = m.n_tokens
                                     AND s.content_hash <> m.content_hash) AS mismatches
                FROM read_parquet('{manifest}') m LEFT JOIN starts s USING (record_key)
                WHERE m.split = 'train' GROUP BY m.record_key)
            SELECT count(*) FILTER (WHERE e = 0), count(*) FILTER (WHERE e = 1),
                count(*) FILTER (WHERE e = 2), count(*) FILTER (WHERE e >= 3),
                coalesce(sum(e), 0), coalesce(sum(mismatches), 0),
                count(*) FILTER (WHERE hosts >= 2),
                coalesce(sum(hosts) FILTER (WHERE hosts >= 2), 0)
            FROM per""").fetchone()
    finally:
        con.close()
    h0, h1, h2, h3, exposures, mismatches, multi, multi_pairs = map(int, row)
    return {"histogram": [h0, h1, h2, h3], "never_seen": h0, "exposures": exposures,
            "hash_mismatches": mismatches, "multi_host_records": multi,
            "multi_host_pairs": multi_pairs}


def spool_query_agrees(report: dict, ref: dict) -> bool:
    """Whether a reconcile report gives the spool query's numbers."""
    cov, hosts = report["coverage"], report["hosts"]["per_host"]
    return ((cov["exposures"], list(cov["histogram"].values())) == (ref["exposures"],
                                                                     ref["histogram"])
            and report["integrity"]["hash_mismatches"] == ref["hash_mismatches"]
            and sum(h["overlap_with_others"] for h in hosts) == ref["multi_host_pairs"])


class PeakRSS:
    """Peak resident memory of this process and all its children, and their CPU seconds,
    sampled every 0.2 s (a child's CPU time is its last sample)."""

    def __init__(self, children_only: bool = False) -> None:
        # children_only: a job run as its own process (`tally ...`), without this process's
        # memory (a long bench holds DuckDB's buffers and mapped index runs of earlier stages).
        self.peak, self._stop, self.children_only = 0, threading.Event(), children_only
        self._cpu: dict[int, float] = {}

    def __enter__(self):
        me = psutil.Process()
        t = me.cpu_times()
        self._cpu0 = 0.0 if self.children_only else t.user + t.system
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _sample(self) -> None:
        me = psutil.Process()
        total = 0
        for p in [*([] if self.children_only else [me]), *me.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                total += p.memory_info().rss
                t = p.cpu_times()
                self._cpu[p.pid] = t.user + t.system
        self.peak = max(self.peak, total)

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self._sample()

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()
        self._sample()
        self.cpu = sum(self._cpu.values()) - self._cpu0


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=50_000_000)
    ap.add_argument("--records", type=int, default=10_000_000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--file-rows", type=int, default=100_000, help="rows per spool file")
    ap.add_argument("--mode", default="in_memory",
                    help="FnApiRunner mode(s), comma-separated: in_memory (the command line's "
                         "default: --workers threads in one process), multi_processing")
    ap.add_argument("--repeats", type=int, default=1, help="Beam runs after the reference")
    ap.add_argument("--reuse", action="store_true",
                    help="keep the manifest, spool and ledger of an earlier run in --dir")
    ap.add_argument("--dir", default="bench/out/reconcile")
    ap.add_argument("--reference", choices=("query", "sql", "both"), default="query",
                    help="query: one DuckDB query over the spool (the issue's); sql: the "
                         "ledger oracle of every number (ingests the spool first)")
    ap.add_argument("--keep", action="store_true", help="keep --dir afterwards")
    args = ap.parse_args(argv)
    allocator.tune()  # as the command line runs (before this process starts a thread)
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench.reference.reconcile_sql import reference

    out = Path(args.dir)
    sql = args.reference in ("sql", "both")
    sizes = f"{args.rows} {args.records} {args.file_rows}"
    t0 = time.perf_counter()
    if not (args.reuse and (out / "sizes").exists() and (out / "sizes").read_text() == sizes):
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        make_spool(out / "spool", args.rows,
                   make_manifest(out / "manifest.parquet", args.records),
                   per_file=args.file_rows)
        (out / "sizes").write_text(sizes)
    if sql and not (out / "ledger.duckdb").exists():
        with Ledger(out / "ledger.duckdb") as ledger:
            ingest(out / "spool", ledger)
    rows = sum(pq.read_metadata(f).num_rows
               for f in (out / "spool" / "bench").glob("attempt=*/host=*/seg-*.parquet"))
    print(f"setup: {args.records:,}-record manifest, {rows:,} rows; "
          f"{time.perf_counter() - t0:.0f} s")

    refs = []  # (name, seconds, PeakRSS)
    if args.reference in ("query", "both"):
        t0 = time.perf_counter()
        with PeakRSS() as mem_q:
            ref = spool_query(out / "spool", "bench", out / "manifest.parquet", out)
        refs.append(("one DuckDB query over the spool", time.perf_counter() - t0, mem_q))
    if sql:
        t0 = time.perf_counter()
        with PeakRSS() as mem_s:
            oracle = reference(str(out / "ledger.duckdb"), str(out / "manifest.parquet"),
                               "bench")
        refs.append(("DuckDB SQL oracle (bench/reference/reconcile_sql.py)",
                     time.perf_counter() - t0, mem_s))
    for name, secs, mem_ref in refs:
        print(f"{name}: {secs:.1f} s = {rows / secs / 1e6:.2f} M rows/s, "
              f"{mem_ref.cpu:.0f} CPU s, peak RSS {mem_ref.peak / 2**30:.2f} GiB")
    _, ref_s, mem_ref = refs[0]

    runs = []
    for mode in [m for m in args.mode.split(",") for _ in range(args.repeats)]:
        t0 = time.perf_counter()
        with PeakRSS() as mem:
            report = reconcile(run_id="bench", manifest=out / "manifest.parquet",
                               out=out / "report", spool=out / "spool",
                               runner=RunnerSpec("direct", mode=mode,
                                                 workers=args.workers))
        beam_s = time.perf_counter() - t0
        got = report["coverage"]
        if args.reference == "sql":
            same = (got["exposures"], list(got["histogram"].values())) == (
                oracle["exposures"], oracle["histogram"])
        else:
            same = spool_query_agrees(report, ref)
        if not same:
            print(f"MISMATCH: reconcile {got['exposures']} exposures {got['histogram']} "
                  f"against the reference's")
        print(f"Beam reconcile, FnApiRunner {mode}: {beam_s:.1f} s = "
              f"{rows / beam_s / 1e6:.2f} M rows/s, {mem.cpu:.0f} CPU s, peak RSS "
              f"{mem.peak / 2**30:.2f} GiB; ratio to the reference {ref_s / beam_s:.2f} "
              f"(CPU s {mem_ref.cpu / mem.cpu:.2f})")
        runs.append({"mode": mode, "beam_s": beam_s, "peak": mem.peak, "cpu": mem.cpu,
                     "same": same})
    best = min(runs, key=lambda r: r["beam_s"])
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)
    return {"rows": rows, "ref_s": ref_s, "ref_cpu": mem_ref.cpu, **best,
            "ratio": ref_s / best["beam_s"]}


if __name__ == "__main__":
    main()
