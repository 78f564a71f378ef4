"""The seed run's shape end to end, in one command: manifest, spool, ingest, serve, reconcile.

Builds a `--records`-record manifest and a spool of `--rows` consumption rows from `--hosts`
hosts through the real writer: documents packed into rows of `--seq-len` tokens (concatenate,
then split, so a row holds several documents and a document can cross rows), each row cut into
document-level segments with their offsets, a fresh permutation of the records each epoch, for
as many epochs as the rows take (~4 at the default shapes). Then, each stage timed and printed
with its ratio against a reference measured in the same run where one exists:

1. manifest: the Beam manifest job (FnApiRunner) on a `--corpus-records` synthetic corpus
   against one plain Python process hashing it (bench.manifest_rate); the seed manifest itself
   is written directly (a corpus of `--records` documents would not fit the disk);
2. spool write: every host's rows through `LedgerWriter` (rows/s);
3. ingest: `tally ingest` (checks, aggregates, lookup index, state snapshot) against a plain
   DuckDB `INSERT ... SELECT` of the same Arrow rows (bench.ingest_rate, on up to
   `--ref-rows` of them);
4. restart: `tally serve` with its per-record state rebuilt (no snapshot) vs restored from the
   snapshot (bench.restart);
5. serve: p50/p99 per endpoint, sequential and from `--clients` processes at once, while a
   writer adds `--live-rows-per-s` rows a second (bench.api_latency), against one SQL scan per
   answer; the server's peak RSS and the state's bytes per record;
6. record lookup by key and by content hash, with the lookup index vs a scan
   (bench.lookup_latency);
7. reconcile: the Beam job on FnApiRunner against one DuckDB query over the same spool and
   manifest (histogram, never seen, hash mismatches, records on 2+ hosts:
   bench.reconcile_rate.spool_query), the same numbers asserted; and unless
   `--no-sql-reference`, against the SQL oracle of every number (bench/reference/reconcile_sql.py).

The data (up to ~40 GB at the defaults) is removed at the end, also on failure, unless `--keep`.
A benchmark, not a test: tests/test_bench.py runs it at a toy size.

    python -m bench.seed_scale [--records 100000000] [--rows 500000000] [--hosts 128]
        [--dir bench/out/seed] [--keep]
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from bench import api_latency, ingest_rate, lookup_latency, manifest_rate, restart
from bench.api_latency import RUN, write
from bench.reconcile_rate import DOMAINS, PeakRSS, spool_query, spool_query_agrees
from tally.audit.hook import spool as sp
from tally.audit.hook.segments import Segments
from tally.audit.ledger import lookup
from tally.audit.ledger.database import Ledger
from tally.pipeline.manifest import (
    MANIFEST_SCHEMA,
    ROW_GROUP_RECORDS,
    Fingerprint,
    build_manifest,
)
from tally.pipeline.manifest_file import manifest_metadata
from tally.pipeline.runners import RunnerSpec
from tally.pipeline.synth import synth_corpus

ROOT = Path(__file__).resolve().parent.parent
_A = 2_654_435_761  # multiplier of the per-epoch permutation: coprime to the record count
MIN_LEN, LEN_SPAN = 16, 1200  # document lengths 16..1215 tokens (mean ~615)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a well-spread uint64 per input (uint64 arithmetic wraps)."""
    h = np.asarray(x, np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    h ^= h >> np.uint64(31)
    h *= np.uint64(0xBF58476D1CE4E5B9)
    h ^= h >> np.uint64(29)
    return h


def record_hash(keys: np.ndarray) -> np.ndarray:
    """The seed manifest's content hash of each record (what the writer would have hashed)."""
    return _mix(keys)


def record_length(keys: np.ndarray) -> np.ndarray:
    return (MIN_LEN + (_mix(keys) >> np.uint64(40)) % np.uint64(LEN_SPAN)).astype(np.int64)


def _strings(codes: np.ndarray, names) -> pa.Array:
    return pa.DictionaryArray.from_arrays(pa.array(codes), pa.array(list(names))).cast(
        pa.string())


def write_manifest(path: Path, n: int, chunk: int = 8 * ROW_GROUP_RECORDS) -> None:
    """The seed manifest (all train), written a chunk at a time: at 100M records one table
    would need ~10 GB (bench.reconcile_rate.make_manifest builds it whole)."""
    fp = Fingerprint()
    with pq.ParquetWriter(path, MANIFEST_SCHEMA) as w:
        for lo in range(0, n, chunk):
            keys = np.arange(lo, min(n, lo + chunk), dtype=np.int64)
            t = pa.table({
                "record_key": keys, "content_hash": record_hash(keys),
                "n_tokens": record_length(keys).astype(np.int32),
                "domain": _strings((_mix(keys + n) % np.uint64(4)).astype(np.int32), DOMAINS),
                "split": _strings(np.zeros(len(keys), np.int32), ["train"]),
                "source": _strings((keys // 500_000 - lo // 500_000).astype(np.int32),
                                   [f"train-{s}" for s in range(lo // 500_000,
                                                                keys[-1] // 500_000 + 1)]),
                "source_index": keys % 500_000,
                "doc_id": pa.nulls(len(keys), pa.string()),
            }, schema=MANIFEST_SCHEMA)
            fp.update(t)
            w.write_table(t, row_group_size=ROW_GROUP_RECORDS)
        w.add_key_value_metadata(manifest_metadata(fp.hexdigest(), n, n))


class PackedLoader:
    """A packed loader's document-level segments, `hosts` x `batch` rows of `seq_len` tokens a
    step (bench.api_latency.Loader's interface: `segments(step, host)`, steps in order).

    The document stream is epoch after epoch of a permutation of the records (document d:
    epoch d // N, key (A * (d mod N) + 7919 * epoch) mod N), concatenated and cut into rows;
    row r of a step belongs to host r // batch. A segment is the part of a document inside one
    row: its record key, offset in the document, tokens and hash (the record's hash when it is
    the whole document, as the manifest has it; another for a part)."""

    def __init__(self, records: int, hosts: int, batch: int, seq_len: int) -> None:
        self.n, self.hosts, self.batch, self.seq_len = records, hosts, batch, seq_len
        self.a = _A % records or 1
        while np.gcd(self.a, records) != 1:
            self.a += 1
        self.doc, self.consumed = 0, 0  # the next document and its tokens already in rows
        self.step, self.per_host = -1, []

    def skip_to(self, step: int) -> None:
        """Stand where `segments(step, ...)` comes next, as if steps 0..step-1 had been made:
        the document holding the first token not consumed, and its tokens consumed (a reused
        spool's run goes on from there; documents' lengths summed a chunk at a time)."""
        tokens, first, start, chunk = step * self.hosts * self.batch * self.seq_len, 0, 0, 1 << 24
        while True:
            d = first + np.arange(chunk, dtype=np.int64)
            epoch, i = np.divmod(d, self.n)
            lens = record_length((self.a * i + 7_919 * epoch) % self.n)
            ends = start + np.cumsum(lens)
            if ends[-1] > tokens:
                j = int(np.searchsorted(ends, tokens, "right"))  # the first ending beyond
                self.doc, self.consumed = int(d[j]), int(tokens - (ends[j] - lens[j]))
                self.step, self.per_host = step - 1, []
                return
            first, start = first + chunk, int(ends[-1])

    def segments(self, step: int, host: int) -> Segments:
        if step != self.step:
            if step != self.step + 1:
                raise ValueError(f"PackedLoader: step {step} after {self.step} (steps in order)")
            self.per_host, self.step = self._make(), step
        return self.per_host[host]

    def _make(self) -> list[Segments]:
        per_host = self.batch * self.seq_len
        total = self.hosts * per_host
        k = int(total / (MIN_LEN + LEN_SPAN / 2) * 1.2) + 16
        while True:
            d = self.doc + np.arange(k, dtype=np.int64)
            epoch, i = np.divmod(d, self.n)
            keys = (self.a * i + 7_919 * epoch) % self.n
            lens = record_length(keys)
            ends = np.cumsum(lens) - self.consumed  # token position where each document ends
            if ends[-1] >= total:
                break
            k *= 2
        m = int(np.searchsorted(ends, total, "left")) + 1  # documents that reach into the step
        d, epoch, keys, lens, ends = d[:m], epoch[:m], keys[:m], lens[:m], ends[:m]
        starts = ends - lens
        cuts = np.union1d(starts[starts > 0], np.arange(0, total, self.seq_len))
        which = np.searchsorted(ends, cuts, "right")
        offset = cuts - starts[which]
        n_tokens = np.diff(np.r_[cuts, total])
        h = record_hash(keys[which])
        whole = (offset == 0) & (n_tokens == lens[which])
        h[~whole] = _mix(h[~whole] ^ (offset[~whole].astype(np.uint64) << np.uint64(20)
                                       | n_tokens[~whole].astype(np.uint64)))
        if ends[-1] == total:
            self.doc, self.consumed = int(d[-1]) + 1, 0
        else:
            self.doc, self.consumed = int(d[-1]), int(total - starts[-1])
        row = cuts // self.seq_len
        bounds = np.searchsorted(cuts, np.arange(self.hosts + 1) * per_host)
        return [Segments.build(row=row[lo:hi] % self.batch, record_key=keys[which[lo:hi]],
                               offset=offset[lo:hi], n_tokens=n_tokens[lo:hi],
                               content_hash=h[lo:hi], epoch=epoch[which[lo:hi]])
                for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]


def _disk(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


class Stages:
    """Each stage's measure, reference and ratio, printed as they come and once more at the
    end as one table."""

    def __init__(self, out: Path) -> None:
        self.out, self.rows, self.peak_disk = out, [], 0

    def add(self, stage: str, measure: str, reference: str = "", ratio: float | None = None
            ) -> None:
        self.peak_disk = max(self.peak_disk, _disk(self.out))
        self.rows.append((stage, measure, reference, ratio))
        print(f"[{stage}] {measure}" + (f"; reference {reference}" if reference else "")
              + (f"; ratio {ratio:,.2f}" if ratio is not None else ""), flush=True)

    def table(self) -> str:
        lines = ["| stage | measured | reference (same run) | ratio |", "| --- | --- | --- | --- |"]
        lines += [f"| {s} | {m} | {r or '—'} | {'—' if x is None else f'{x:,.2f}'} |"
                  for s, m, r, x in self.rows]
        return "\n".join(lines)


STAGES = ("restart", "serve", "lookup", "reconcile")  # after the build (or --reuse)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=100_000_000)
    ap.add_argument("--rows", type=int, default=500_000_000, help="consumption rows (segments)")
    ap.add_argument("--hosts", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32, help="rows per host and step")
    ap.add_argument("--seq-len", type=int, default=2048, help="tokens per row")
    ap.add_argument("--flush-every", type=int, default=100, help="steps per spool file")
    ap.add_argument("--corpus-records", type=int, default=500_000,
                    help="records of the synthetic corpus the manifest job is timed on")
    ap.add_argument("--ref-rows", type=int, default=10_000_000,
                    help="rows of the spool the ingest reference inserts")
    ap.add_argument("--requests", type=int, default=200, help="per endpoint (and client)")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--live-rows-per-s", type=float, default=100_000)
    ap.add_argument("--findings-every", type=float, default=10.0,
                    help="the service's live findings: a live reconcile round this often "
                         "(0: none); their age is measured beside the clients")
    ap.add_argument("--findings-start", choices=("resume", "afresh"), default="resume",
                    help="the service's live reconcile: resumed from a checkpoint made over the "
                         "backlog before the service starts (a restarted service; the backlog's "
                         "full pass is timed on its own), or started afresh by the service (its "
                         "first round the full pass, beside the writer and the clients)")
    ap.add_argument("--clients-seconds", type=float, default=60.0,
                    help="the clients go on at least this long (the window the live ingest "
                         "beside them is timed over)")
    ap.add_argument("--live-flush-every", type=int, default=25,
                    help="steps per spool file while serving (at 128 hosts: ~28 files a "
                         "second at 100k rows/s)")
    ap.add_argument("--lookups", type=int, default=200, help="per kind and method")
    ap.add_argument("--workers", type=int, default=2, help="FnApiRunner multi_processing")
    ap.add_argument("--memory-limit", default="6GB", help="DuckDB memory limit of the service")
    ap.add_argument("--no-sql-reference", action="store_true",
                    help="skip the SQL oracle (every reconcile number from the ledger: hours "
                         "and more memory than 24 GiB at the full size); the one-query "
                         "reference over the spool still runs (--no-spool-query skips it)")
    ap.add_argument("--no-spool-query", action="store_true",
                    help="skip the one-query reference over the spool (the reconcile's ratio)")
    ap.add_argument("--dir", default="bench/out/seed")
    ap.add_argument("--keep", action="store_true", help="keep the data")
    ap.add_argument("--reuse", action="store_true",
                    help="the manifest, spool and ledger a --keep run left in --dir (same "
                         "--records, --hosts, --batch, --seq-len): instead of stages 1-3, one "
                         "`tally ingest` brings the state and lookup index up to date")
    ap.add_argument("--stages", default=",".join(STAGES),
                    help=f"which of {', '.join(STAGES)} to run (comma-separated)")
    args = ap.parse_args(argv)
    args.stages = set(args.stages.split(","))
    if not args.stages <= set(STAGES):
        ap.error(f"--stages: one of {', '.join(STAGES)} each")
    logging.getLogger().setLevel(logging.ERROR)
    out = Path(args.dir)
    if args.reuse:
        missing = [n for n in ("manifest.parquet", "spool", "ledger.duckdb")
                   if not (out / n).exists()]
        if missing:
            ap.error(f"--reuse: {out} has no {', '.join(missing)} (a run with --keep leaves them)")
    else:
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
    try:
        return _run(args, out)
    finally:
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)


def _run(args: argparse.Namespace, out: Path) -> dict:
    st = Stages(out)
    res: dict = {"records": args.records, "hosts": args.hosts}
    manifest, spool, ledger = out / "manifest.parquet", out / "spool", out / "ledger.duckdb"

    loader = PackedLoader(args.records, args.hosts, args.batch, args.seq_len)
    if args.reuse:
        steps, state_bytes = _reused(args, st, res, loader, spool, ledger)
    else:
        steps, state_bytes = _build(args, out, st, res, loader, manifest, spool, ledger)
    if "restart" in args.stages:
        _restart(args, out, st, res, ledger)
    if "serve" in args.stages:
        _serve(args, st, res, loader, spool, ledger, steps, state_bytes, manifest)
    if "lookup" in args.stages:
        _lookups(args, st, res, ledger)
    if "reconcile" in args.stages:
        _reconcile(args, out, st, res, manifest, spool, ledger)
    res["peak_disk"] = st.peak_disk
    print(f"\npeak disk {st.peak_disk / 1e9:.2f} GB (sampled after each stage)\n")
    print(st.table())
    res["table"] = st.table()
    (out / "result.json").write_text(json.dumps(res, default=str))
    return res


def _reused(args, st: Stages, res: dict, loader: PackedLoader, spool: Path, ledger: Path
            ) -> tuple[int, int]:
    """A kept run's data: one `tally ingest` brings the ledger (the files a live writer
    published after the last ingest), the per-record state (rebuilt when it has no snapshot)
    and the lookup index up to date; the loader then stands after the ledger's last step."""
    with PeakRSS() as mem:
        ingest_s = restart._ingest(spool, ledger)
    with Ledger(ledger, read_only=True) as led:
        got = led.query("SELECT count(*) AS n, max(step) AS s FROM consumption")[0]
    rows, steps = int(got["n"]), int(got["s"]) + 1
    t0 = time.perf_counter()
    loader.skip_to(steps)
    skip_s = time.perf_counter() - t0
    state_bytes = _disk(Path(f"{ledger}.state"))
    res.update(rows=rows, steps=steps, epochs=(loader.doc + (loader.consumed > 0)) / args.records,
               state_bytes_per_record=state_bytes / args.records)
    st.add("reused data: `tally ingest` bringing state and lookup index up to date",
           f"{rows:,} rows, {steps:,} steps, {res['epochs']:.2f} epochs: {ingest_s:.1f} s, peak "
           f"RSS {mem.peak / 2**30:.2f} GiB (loader moved to step {steps:,} in {skip_s:.1f} s)")
    return steps, state_bytes


def _build(args, out: Path, st: Stages, res: dict, loader: PackedLoader, manifest: Path,
           spool: Path, ledger: Path) -> tuple[int, int]:
    """Stages 1-3: manifest, spool, ingest."""
    # 1. Manifest: the Beam job on a corpus that fits, against a plain process; then the seed's.
    corpus_records = min(args.corpus_records, args.records)
    synth_corpus(out / "corpus", records=max(corpus_records, 2), seed=0, shards=8)
    t0 = time.perf_counter()
    n = manifest_rate.plain(out / "corpus")
    plain_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    built = build_manifest(out / "corpus", out / "corpus-manifest.parquet", runner=RunnerSpec(
        "direct", mode="multi_processing", workers=args.workers))
    beam_s = time.perf_counter() - t0
    assert built.records == n
    res["manifest_records_per_s"] = n / beam_s
    st.add("manifest (Beam, FnApiRunner multi_processing)",
           f"{n:,} records in {beam_s:.1f} s = {n / beam_s:,.0f} records/s",
           f"one plain process {n / plain_s:,.0f} records/s", plain_s / beam_s)
    shutil.rmtree(out / "corpus")
    t0 = time.perf_counter()
    write_manifest(manifest, args.records)
    st.add("seed manifest (written directly)",
           f"{args.records:,} records in {time.perf_counter() - t0:.1f} s, "
           f"{manifest.stat().st_size / 1e9:.2f} GB")

    # 2. Spool through the real writer.
    probe = PackedLoader(args.records, args.hosts, args.batch, args.seq_len)
    per_step = sum(len(probe.segments(0, h).record_key) for h in range(args.hosts))
    steps = max(1, -(-args.rows // per_step))
    t0 = time.perf_counter()
    rows = write(spool, loader, range(steps), args.flush_every)
    spool_s = time.perf_counter() - t0
    files = sum(1 for f, _ in sp.scan(spool) if getattr(f, "kind", None) == "seg")
    epochs = (loader.doc + (loader.consumed > 0)) / args.records
    res.update(rows=rows, steps=steps, epochs=epochs, spool_s=spool_s)
    st.add("spool write (LedgerWriter, all hosts)",
           f"{rows:,} segments ({steps:,} steps x {args.hosts} hosts x {args.batch} rows of "
           f"{args.seq_len} tokens, {rows / (steps * args.hosts * args.batch):.1f} segments a "
           f"row, {epochs:.2f} epochs) in {files:,} files, {spool_s:.1f} s = "
           f"{rows / spool_s / 1e6:.2f} M rows/s, {_disk(spool) / 1e9:.2f} GB")

    # 3. Ingest (aggregates, lookup index, snapshot) vs a plain insert of the same Arrow rows.
    tables, got = [], 0
    for f, _ in sp.scan(spool):
        if getattr(f, "kind", None) == "seg" and got < args.ref_rows:
            tables.append(pq.read_table(f.path))
            got += tables[-1].num_rows
    ref_s = ingest_rate.reference(tables, out / "reference.duckdb")
    del tables
    (out / "reference.duckdb").unlink()
    with PeakRSS() as mem:
        ingest_s = restart._ingest(spool, ledger)
    state_bytes = _disk(Path(f"{ledger}.state"))
    index_bytes = _disk(Path(f"{ledger}.lookup"))
    res.update(ingest_rate=rows / ingest_s, ingest_ref_rate=got / ref_s,
               state_bytes_per_record=state_bytes / args.records)
    st.add("ingest (`tally ingest`: checks, aggregates, lookup index, snapshot)",
           f"{rows / ingest_s / 1e6:.2f} M rows/s ({ingest_s:.1f} s), peak RSS "
           f"{mem.peak / 2**30:.2f} GiB; ledger {ledger.stat().st_size / 1e9:.2f} GB, index "
           f"{index_bytes / 1e9:.2f} GB, snapshot {state_bytes / 1e9:.2f} GB",
           f"DuckDB INSERT of {got:,} of the Arrow rows {got / ref_s / 1e6:.2f} M rows/s",
           (rows / ingest_s) / (got / ref_s))

    return steps, state_bytes


def _restart(args, out: Path, st: Stages, res: dict, ledger: Path) -> None:
    # 4. Restart: state rebuilt from the ledger vs restored from the snapshot.
    snapshots, aside = Path(f"{ledger}.state"), out / "state.aside"
    snapshots.rename(aside)
    rebuilt = restart.serve_once(ledger, args.records, "no snapshot (rebuild from the ledger):")
    shutil.rmtree(snapshots, ignore_errors=True)
    aside.rename(snapshots)
    restored = restart.serve_once(ledger, args.records, "snapshot, up to date:")
    assert restored["answers"] == rebuilt["answers"]
    res.update(restart_s=restored["first_answer_s"], rebuild_s=rebuilt["first_answer_s"])
    st.add("serve start, state rebuilt (no snapshot)",
           f"first answer {rebuilt['first_answer_s']:.1f} s (state {rebuilt['state_load_s']} s)")
    st.add("restart with the snapshot", f"first answer {restored['first_answer_s']:.1f} s "
           f"(state {restored['state_load_s']} s)", "the rebuild's start",
           rebuilt["first_answer_s"] / restored["first_answer_s"])



def _serve(args, st: Stages, res: dict, loader: PackedLoader, spool: Path, ledger: Path,
           steps: int, state_bytes: int, manifest: Path) -> None:
    # 5. Endpoints while a writer goes on, against one SQL scan per answer.
    with Ledger(ledger) as led:
        ref = api_latency.references(led, 1)
    live_out = Path(f"{ledger}.findings") / RUN
    shutil.rmtree(live_out, ignore_errors=True)
    if args.findings_every and args.findings_start == "resume":
        # The live reconcile's first start over the backlog (the full pass, which a restart
        # made every time before checkpoints), here, before the service: its child resumes.
        from tally.audit.core import allocator
        from tally.audit.reconcile.follow import Follower

        allocator.tune()
        t0 = time.perf_counter()
        follower = Follower(spool, manifest, RUN, live_out)
        follower.round()
        full_s = time.perf_counter() - t0
        res["findings_full_pass_s"] = full_s
        st.add("live reconcile's first start over the backlog (the full pass, alone)",
               f"{full_s:.1f} s, {follower.store.rows:,} rows kept, checkpoint "
               f"{follower.last_save_s} s")
        del follower
        (live_out / "follow.json").unlink(missing_ok=True)  # the service's child writes its own
    live = api_latency.serve_and_time(
        ledger, spool, loader, steps, ref, records=args.records, requests=args.requests,
        clients=args.clients, live_rows_per_s=args.live_rows_per_s,
        live_flush_every=args.live_flush_every, memory_limit=args.memory_limit,
        min_seconds=args.clients_seconds,
        manifest=manifest if args.findings_every else None, findings_every=args.findings_every)
    res["live"] = live
    f = live["findings"]
    first = "resumed" if args.findings_start == "resume" else "the full pass over the backlog"
    if f:
        st.add("live findings beside the writer and the clients",
               f"age p50 {f['age_p50_s']:.1f} s, max {f['age_max_s']:.1f} s; "
               f"{f['rounds']} rounds over {f['seconds']:.0f} s, {f['round_s_mean']:.2f} s "
               f"(max {f['round_s_max']:.2f}) and {f['cpu_per_round_s']:.2f} CPU s a round; "
               f"its first round ({first}) {f['first_round_s']} s",
               f"a round every {args.findings_every:g} s")
    scan = {"summary": "coverage", "coverage": "coverage", "steps_full_range": "steps",
            "hosts": "hosts"}
    for name in live["p99"]:
        c50, c99 = live["p50_concurrent"].get(name), live["p99_concurrent"].get(name)
        both = "" if c50 is None else f"; {args.clients} clients {c50:.1f} / {c99:.1f} ms"
        key = scan.get(name)
        st.add(f"endpoint {name}", f"p50 / p99 {live['p50'][name]:.1f} / "
               f"{live['p99'][name]:.1f} ms{both}",
               f"SQL scan {ref[key] * 1e3:,.0f} ms (ratio to p99)" if key else "",
               ref[key] * 1e3 / live["p99"][name] if key else None)
    rss = live["peak_rss_bytes"] or 0
    st.add("live writer while timing", f"{live['live_rows']:,} rows published, "
           f"{live['ingested_live']:,} ingested by the service, lag at the end "
           f"{live['lag_s']:.1f} s")
    w = live["window"]
    if w:
        st.add(f"live ingest beside {args.clients} clients",
               f"{w['ingested_rows_per_s']:,.0f} rows/s ingested by the service over "
               f"{w['seconds']:.1f} s", f"the writer published {w['written_rows_per_s']:,.0f} "
               "rows/s", w["ingested_rows_per_s"] / max(w["written_rows_per_s"], 1.0))
    res["rss_bytes_per_record"] = rss / args.records
    st.add("serve memory", f"peak RSS {rss / 2**30:.2f} GiB = {rss / args.records:.0f} bytes a "
           f"record; per-record state {state_bytes / args.records:.0f} bytes a record "
           f"({state_bytes / 2**30:.2f} GiB)")



def _lookups(args, st: Stages, res: dict, ledger: Path) -> None:
    # 6. Record lookups, with the index and by a scan.
    with Ledger(ledger) as led:
        index = lookup.for_ledger(led)
        cur = led.cursor()
        keys = np.random.default_rng(0).integers(0, args.records, args.lookups)
        # Hashes of consumed segments: a record's own hash is consumed only where one of its
        # documents was not cut across rows, which a record seen a few times can miss.
        hashes = [int(h) for (h,) in cur.execute(
            "SELECT content_hash FROM consumption USING SAMPLE reservoir("
            f"{int(args.lookups)} ROWS) REPEATABLE (0)").fetchall()]
        for kind, values in (("key", keys.tolist()), ("hash", hashes)):
            scan_ms = lookup_latency._times(cur, kind, values, None)
            fast_ms = lookup_latency._times(cur, kind, values, index)
            p50, p99 = np.percentile(fast_ms, 50), np.percentile(fast_ms, 99)
            s99 = np.percentile(scan_ms, 99)
            res[f"lookup_{kind}_p99"] = float(p99)
            st.add(f"record lookup by {kind} (index)", f"p50 / p99 {p50:.1f} / {p99:.1f} ms",
                   f"scan p50 / p99 {np.percentile(scan_ms, 50):.1f} / {s99:.1f} ms", s99 / p99)
        cur.close()



def _reconcile(args, out: Path, st: Stages, res: dict, manifest: Path, spool: Path,
               ledger: Path) -> None:
    # 7. Reconcile: the rows the live writer added go into the ledger first, so that the SQL
    # oracle (ledger) and the Beam job (spool) see the same rows. The Beam job runs first: a
    # reference that fails at the full size (the oracle's memory) leaves its numbers printed.
    restart._ingest(spool, ledger)
    shutil.rmtree(Path(f"{ledger}.lookup"), ignore_errors=True)  # disk: neither needs them
    shutil.rmtree(Path(f"{ledger}.state"), ignore_errors=True)
    with Ledger(ledger, read_only=True) as led:
        total = int(led.query("SELECT count(*) AS n FROM consumption")[0]["n"])
    # `tally reconcile` in its own process, measured alone: in this process the job's driver
    # was measured with the bench's own memory (7.6 GB at 500M rows: DuckDB's buffers and the
    # lookup index's mapped runs of the stages before).
    t0 = time.perf_counter()
    with PeakRSS(children_only=True) as mem:
        p = restart._tally("reconcile", "--spool", str(spool.resolve()), "--manifest",
                           str(manifest.resolve()), "--run", RUN, "-o",
                           str((out / "report").resolve()), "--mode", "multi_processing",
                           "--workers", str(args.workers), "-q", "--json")
        said, _ = p.communicate()
    beam_s = time.perf_counter() - t0
    if p.returncode:
        raise RuntimeError(said)
    report = json.loads((out / "report" / "report.json").read_text())
    cov = report["coverage"]
    res.update(reconcile_rate=total / beam_s, reconcile_peak=mem.peak,
               verdict=report.get("verdict"), exposures=cov["exposures"])
    st.add("reconcile (Beam, FnApiRunner multi_processing)",
           f"{total:,} rows in {beam_s:.1f} s = {total / beam_s / 1e6:.2f} M rows/s, "
           f"{mem.cpu:.0f} CPU s, peak RSS {mem.peak / 2**30:.2f} GiB; verdict "
           f"{report.get('verdict')}, {cov['exposures']:,} exposures")
    if not args.no_spool_query:
        _spool_query(st, res, report, beam_s, out, manifest, spool)
    if not args.no_sql_reference:
        sys.path.insert(0, str(ROOT))
        from bench.reference.reconcile_sql import reference

        t0 = time.perf_counter()
        with PeakRSS() as mem_ref:
            sql = reference(str(ledger), str(manifest), RUN)
        sql_s = time.perf_counter() - t0
        assert (cov["exposures"], list(cov["histogram"].values())) == (sql["exposures"],
                                                                       sql["histogram"])
        st.add("reconcile vs the SQL oracle (bench/reference/reconcile_sql.py, every number)",
               f"Beam {beam_s:.1f} s, the same numbers",
               f"DuckDB SQL {sql_s:.1f} s, {mem_ref.cpu:.0f} CPU s, peak RSS "
               f"{mem_ref.peak / 2**30:.2f} GiB", sql_s / beam_s)


def _spool_query(st: Stages, res: dict, report: dict, beam_s: float, out: Path,
                 manifest: Path, spool: Path) -> None:
    """The issue's reference: one DuckDB query over the same spool and manifest."""
    tmp = out / "duckdb.tmp"
    t0 = time.perf_counter()
    try:
        with PeakRSS() as mem_q:
            q = spool_query(spool, RUN, manifest, tmp)
    except duckdb.OutOfMemoryException as exc:
        # At 500M rows the query's hash aggregate needs ~19-20 GiB: it ran once at 20.0 GiB
        # and ran out of DuckDB's default limit (80% of 24 GiB) twice on the same data.
        res["spool_query_error"] = str(exc).splitlines()[0]
        st.add("reconcile vs one DuckDB query over the spool", f"Beam {beam_s:.1f} s",
               f"the query ran out of memory after {time.perf_counter() - t0:.0f} s: "
               f"{res['spool_query_error']}")
        return
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    q_s = time.perf_counter() - t0
    cov = report["coverage"]
    assert spool_query_agrees(report, q), (q, cov)
    res.update(spool_query_s=q_s, reconcile_ratio=q_s / beam_s, spool_query=q)
    st.add("reconcile vs one DuckDB query over the spool",
           f"Beam {beam_s:.1f} s; the query's histogram {q['histogram']}, "
           f"{q['hash_mismatches']:,} hash mismatches, {q['multi_host_records']:,} records on "
           f"2+ hosts: the report's",
           f"the query {q_s:.1f} s, {mem_q.cpu:.0f} CPU s, peak RSS "
           f"{mem_q.peak / 2**30:.2f} GiB", q_s / beam_s)


if __name__ == "__main__":
    main()
