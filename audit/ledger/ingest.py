"""Exactly-once ingest of spool files into the ledger.

Each published file is checked (footer, schema, metadata, row count, values) and then ingested
in one transaction together with its `segments` row and its share of the aggregates, so a file
is in the ledger entirely or not at all, and a file already listed in `segments` is skipped:
re-running ingest, or being killed in the middle of it, never counts a row twice. "Already
listed" means the same file: its stat unchanged since, or its Parquet footer the same; another
file at that path, or a file of another spool id than the one the ledger holds its attempt and
host from (a run id reused after its spool was removed), is quarantined. Files go in
by batches (about two million rows, one transaction each): a commit and the aggregate tables'
upserts cost about as much for a batch as for one file. A file that fails a check is
quarantined (listed in the ledger's `quarantine` table with the reason, and reported); the other
files still ingest. A quarantined file is tried again only if it changes on disk.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from tqdm import tqdm

from tally.audit.core import allocator
from tally.audit.core.exposure import starts
from tally.audit.core.logs import info_line, terminal
from tally.audit.core.schema import METRIC_COLUMNS, SEGMENT_COLUMNS_ALL, sql_select
from tally.audit.hook import spool as sp
from tally.audit.hook.spool import BadFile, read_checked
from tally.audit.ledger import lookup
from tally.audit.ledger.aggregates import Aggregates, for_ledger
from tally.audit.ledger.database import Ledger
from tally.audit.ledger.integrity import IngestIntegrity, segment_columns
from tally.audit.ledger.state import Starts

log = logging.getLogger("tally.ingest")


@dataclass
class IngestResult:
    files: int = 0
    rows: int = 0
    already: int = 0
    quarantined: list[tuple[str, str]] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        rate = self.rows / self.seconds if self.seconds > 0 else 0.0
        s = (f"ingested {self.files} files ({self.rows:,} rows) in {self.seconds:.2f} s "
             f"({rate:,.0f} rows/s); {self.already} already in the ledger")
        if self.quarantined:
            s += f"; {len(self.quarantined)} quarantined"
        return s


# Rows per transaction (fewer when the backlog is shorter). A batch's fixed costs (its
# statements, the COMMIT, the pending table's settling) made 1M-row batches of 8 hosts' 100k-row
# files 8-12% slower than 2M-row ones (20M rows: 1.46-1.48 against 1.53-1.67 M rows/s on this
# 2-core box; 16 hosts' 500k-row files alike either way), for ~250 MB more at the peak.
BATCH_ROWS = 2_000_000
# Files per transaction at most: a batch's fixed costs (its statements, the aggregate upserts,
# the state's passes over its records) are paid per batch, and 128 hosts' files of ~6.5k rows
# filled 64 files at 0.42M rows: 10M rows ingested in 8.7 s that way, 7.35 s in 1M-row batches.
BATCH_FILES = 256
READ_AHEAD_BYTES = 64 << 20  # spool bytes read ahead of the transactions


@dataclass
class _File:
    """A checked spool file, read and pre-aggregated, waiting for its transaction."""

    item: sp.SpoolFile
    stat: os.stat_result
    table: pa.Table
    info: dict
    steps: pa.Table | None  # per (host, step): segments, tokens, starts
    starts: Starts | None
    n_tokens: int
    held: bool = False  # quarantined before, changed since
    run: int = 0


class _Rejected(Exception):
    def __init__(self, f: _File, reason: str) -> None:
        super().__init__(reason)
        self.file = f


def ingest(spool: str | Path, ledger: Ledger, *, progress: bool = False,
           batch_rows: int = BATCH_ROWS,
           listing: list[tuple[sp.SpoolFile | sp.Stray, os.stat_result]] | None = None,
           final: bool = False, stop: threading.Event | None = None,
           integrity: IngestIntegrity | None = None,
           catch_up_seconds: float | None = None) -> IngestResult:
    """Ingest every new published file under `spool` into `ledger`, exactly once, then write
    the state snapshots that are due (tally.audit.ledger.snapshot).

    `listing`: the spool's entries with their stat, when the caller has just scanned it (the
    live service); files among them already in the ledger are skipped all the same.
    `final`: the process's last ingest (`tally ingest`): a snapshot due is written now rather
    than after its interval.
    `stop`: once set, the ingest ends after the batch under way (each batch is one
    transaction); the files after it wait for the next ingest. The live service's stop: a
    round through a backlog of 100M rows from 128 hosts outlasted a minute's grace.
    `integrity`: each segment file's rows checked against its manifest in the file's
    transaction (tally.audit.ledger.integrity); files ingested before are checked afterwards,
    all of them, or for about `catch_up_seconds` (the live service: the rest in its next
    rounds)."""
    t0 = time.perf_counter()
    result = IngestResult()
    if integrity is not None:
        integrity.ready()  # the manifest's cache built (once) before any transaction begins
    agg = for_ledger(ledger)  # the aggregates' per-record state, loaded once per process
    with agg.ingesting:  # one ingest at a time per process: each sees the last one's files
        _ingest(Path(spool), ledger, agg, progress, batch_rows, listing, result, stop,
                integrity)
        agg.save_locked(ledger, final=final)
    if integrity is not None:
        cur = ledger.cursor()
        try:
            integrity.catch_up(cur, stop=stop, seconds=catch_up_seconds)
        finally:
            cur.close()
    allocator.release()  # the batches' freed temporaries, kept for speed, back between rounds
    result.seconds = time.perf_counter() - t0
    return result


def _ingest(spool: Path, ledger: Ledger, agg: Aggregates, progress: bool, batch_rows: int,
            listing: list | None, result: IngestResult, stop: threading.Event | None,
            integrity: IngestIntegrity | None) -> None:
    cur = ledger.cursor()
    try:
        only = "" if listing is None else "WHERE path IN (SELECT unnest($1))"
        params = [] if listing is None else [[item.rel for item, _ in listing]]
        done = {r[0]: r[1:] for r in cur.execute(
            f"SELECT path, bytes, mtime_ns, footer_hash, spool_id FROM segments {only}",
            params).fetchall()}
        held = {r[0]: (r[1], r[2]) for r in cur.execute(
            f"SELECT path, bytes, mtime_ns FROM quarantine {only}", params).fetchall()}
        todo = []
        again: dict[str, tuple] = {}  # ingested paths whose file changed since: read again
        for item, st in listing if listing is not None else sp.scan(spool):
            was = done.get(item.rel)
            if was is not None:
                if was[1] is None or (st.st_size, st.st_mtime_ns) == tuple(was[:2]):
                    result.already += 1  # unchanged (or ingested before stats were kept)
                    continue
                again[item.rel] = was
            if held.get(item.rel) == (st.st_size, st.st_mtime_ns):
                continue  # known bad and unchanged: reported by `tally ledger`, not again here
            todo.append((item, st))
        # In step order across hosts (the listing is host by host): the per-record state
        # settles record starts behind a watermark of the hosts' steps (tally.audit.ledger.state),
        # and a backfill of a whole spool host by host would put every later host's files
        # below it.
        todo.sort(key=_step_order)
        if progress and todo and not terminal():  # one line, no redraws, off a terminal
            info_line("tally.progress", f"ingest: {len(todo):,} files")
        bar = tqdm(total=len(todo), unit="file", desc="ingest",
                   disable=not (progress and terminal()), file=sys.stderr)
        batch: list[_File] = []
        rows = 0
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="tally-ingest-rows") as pool, \
                _Indexer(ledger) as index:
            for (item, st), read in _read_ahead(todo):
                if stop is not None and stop.is_set():
                    batch = []  # not begun: its files wait for the next ingest
                    break
                bar.update()
                if item.rel in again:
                    _seen_again(cur, result, item.rel, st, read, again[item.rel])
                    continue
                if isinstance(read, BadFile):
                    _quarantine(cur, result, item.rel, st, str(read))
                    continue
                batch.append(_File(item, st, *read, held=item.rel in held))
                rows += read[0].num_rows
                if rows >= batch_rows or len(batch) >= BATCH_FILES:
                    index.kick(_ingest_batch(ledger, cur, agg, pool, batch, result, integrity))
                    batch, rows = [], 0
            if batch:
                index.kick(_ingest_batch(ledger, cur, agg, pool, batch, result, integrity))
        bar.close()
    finally:
        cur.close()


def _step_order(entry: tuple) -> tuple:
    item = entry[0]
    if isinstance(item, sp.SpoolFile):
        return (0, item.run_id, item.attempt, item.first_step, item.host, item.kind, item.seq)
    return (1, item.rel)


class _Indexer:
    """The record lookup index catches up with the committed files in a thread of its own,
    while the next batch goes in: its sorts and writes were a quarter of the ingesting thread's
    time (10M rows from 128 hosts on this 2-core box), and they release the GIL. On leaving,
    it catches up with every file committed, so an ingest returns with the index current. The
    index only speeds lookups up (files it does not cover are scanned), so a failure here is
    logged, never raised."""

    # Rows whose columns wait for the index at most (16 bytes a row: 64 MiB). The index is a
    # batch or two behind; one that lags further reads the rest back from the ledger.
    HELD_ROWS = 1 << 22

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tally-ingest-index")
        self.running: Future | None = None
        # File id -> (record keys, content hashes) of segment files committed and not yet
        # indexed: the index takes them from here rather than from the ledger.
        self.columns: dict[int, tuple] = {}
        self.lock = threading.Lock()

    def __enter__(self) -> _Indexer:
        return self

    def kick(self, committed: list[tuple[int, pa.Table]] = ()) -> None:
        """Start a catch-up unless one is running (the next one takes what this one missed);
        `committed`: the segment files just committed, by file id."""
        with self.lock:
            held = sum(len(k) for k, _ in self.columns.values())
            for fid, table in committed:
                if held >= self.HELD_ROWS:
                    break
                self.columns[fid] = (table["record_key"], table["content_hash"])
                held += table.num_rows
        if self.running is None or self.running.done():
            self.running = self.pool.submit(self._catch_up)

    def __exit__(self, *exc) -> None:
        try:
            if self.running is not None:
                self.running.result()
            if exc[0] is None:
                self.pool.submit(self._catch_up).result()
        finally:
            self.pool.shutdown(wait=True)

    def _catch_up(self) -> None:
        cur = self.ledger.cursor()
        try:
            index = lookup.for_ledger(self.ledger)
            while True:
                with self.lock:
                    held = dict(self.columns)
                done = index.catch_up(cur, columns=held)
                with self.lock:  # indexed (or passed over): not wanted again
                    upto = index.coverage.upto
                    for fid in [f for f in self.columns if f <= upto]:
                        del self.columns[fid]
                if not done:
                    break
        except Exception as exc:  # noqa: BLE001 (a disk full, a damaged run: lookups scan)
            log.warning("lookup index not updated: %s: %s", type(exc).__name__, exc)
            with self.lock:
                self.columns.clear()
        finally:
            cur.close()


def _read(item: sp.SpoolFile | sp.Stray
          ) -> tuple[pa.Table, dict, pa.Table | None, Starts | None, int] | BadFile:
    """Read, check and pre-aggregate one file (runs in the read-ahead thread)."""
    if isinstance(item, sp.Stray):
        return BadFile(item.reason)
    try:
        return _read_file(item)
    except BadFile as exc:
        return exc
    except Exception as exc:  # whatever a file holds, it is this file's fault, not the ingest's
        return BadFile(f"unreadable: {type(exc).__name__}: {exc}")


def _read_file(item: sp.SpoolFile
               ) -> tuple[pa.Table, dict, pa.Table | None, Starts | None, int]:
    table, info = read_checked(item)
    if item.kind != "seg":
        return table, info, None, None, 0
    steps = _per_step(table, info["host"])
    starts_of = Starts.from_table(table, info["host"], info["attempt"], info["host_count"])
    return table, info, steps, starts_of, pc.sum(table["n_tokens"]).as_py()


def _per_step(table: pa.Table, host: int) -> pa.Table:
    """A segment file's rows, starts and tokens per step (its `agg_steps` rows; one host a
    file, checked at read). A writer's file holds its steps in order, so each step's rows are
    one run: reduced in place (pyarrow's group_by took 12.5 s of a 100M-row ingest's reading
    thread); any other order is sorted first."""
    step = table["step"].to_numpy()
    tokens = table["n_tokens"].to_numpy().astype(np.int64)
    start = starts(table["offset"].to_numpy()).astype(np.int64)
    if len(step) > 1 and (step[1:] < step[:-1]).any():
        order = np.argsort(step, kind="stable")
        step, tokens, start = step[order], tokens[order], start[order]
    head = np.flatnonzero(np.r_[True, step[1:] != step[:-1]]) if len(step) else \
        np.zeros(0, np.int64)
    return pa.table({"host": pa.array(np.full(len(head), host, np.int32)),
                     "step": step[head],
                     "n_tokens_count": np.diff(np.r_[head, len(step)]).astype(np.int64),
                     "n_tokens_sum": np.add.reduceat(tokens, head) if len(head) else
                     np.zeros(0, np.int64),
                     "start_sum": np.add.reduceat(start, head) if len(head) else
                     np.zeros(0, np.int64)})


def _read_ahead(todo: list) -> Iterator:
    """`(entry, _read(entry))` in order, reading ahead of the inserts up to READ_AHEAD_BYTES of
    spool files (at least one batch's worth, so that the next batch reads while this one
    commits).

    Parquet decoding and DuckDB's insert both release the GIL, so they overlap; the bound keeps
    memory at a few batches whatever the size of the backlog.
    """
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="tally-ingest-read") as pool:
        try:
            yield from _ahead(todo, pool)
        except GeneratorExit:  # the consumer stopped: the reads not begun are not wanted
            pool.shutdown(wait=True, cancel_futures=True)
            raise


def _ahead(todo: list, pool: ThreadPoolExecutor) -> Iterator:
    pending: deque = deque()
    ahead = 0
    for entry in todo:
        pending.append((entry, pool.submit(_read, entry[0])))
        ahead += entry[1].st_size
        while ahead > READ_AHEAD_BYTES or len(pending) > 2 * BATCH_FILES:
            first, fut = pending.popleft()
            ahead -= first[1].st_size
            yield first, fut.result()
    while pending:
        first, fut = pending.popleft()
        yield first, fut.result()


def _seen_again(cur, result: IngestResult, rel: str, st, read, was: tuple) -> None:
    """A file at a path already ingested, changed on disk since (`was`: the ledger's bytes,
    mtime, footer hash and spool id of the file ingested from it). The same file (a spool
    restored from a copy, a file touched) is skipped, its stat kept for the next listing;
    another file is quarantined: the ledger keeps the one it ingested. A run id reused after
    its spool was removed puts a new training's files at the old names."""
    if isinstance(read, BadFile):
        _quarantine(cur, result, rel, st, f"a different file at a path already ingested: {read}")
        return
    info = read[1]
    if info["footer_hash"] == was[2]:
        cur.execute("UPDATE segments SET bytes = ?, mtime_ns = ? WHERE path = ?",
                    [st.st_size, st.st_mtime_ns, rel])
        cur.execute("DELETE FROM quarantine WHERE path = ?", [rel])  # another file was there
        result.already += 1
        return
    what = "another file at a path already ingested"
    reason = _reused(info, was[3], what)
    if reason is None:
        reason = (f"{what} (its Parquet footer differs from the one ingested): a file "
                  f"rewritten, or run id {info['run_id']} reused after its spool was removed; "
                  "the ledger keeps the file it ingested first")
    _quarantine(cur, result, rel, st, reason)


REUSED = " reused:"  # in a quarantine reason: a file of another training under the run's id


def is_reuse(reason: str) -> bool:
    """Whether a quarantine reason is `_reused`'s (reconcile, diff and exposure count these
    files apart from unreadable ones)."""
    return reason.startswith("run id ") and REUSED in reason


def _reused(info: dict, theirs: str | None, what: str) -> str | None:
    """Why a file of spool id `info["spool_id"]` cannot join its attempt and host, which the
    ledger holds from spool `theirs`; None when they agree or either is unknown (files
    written before spool ids)."""
    mine = info.get("spool_id")
    if mine is None or theirs is None or mine == theirs:
        return None
    return (f"run id {info['run_id']}{REUSED} {what} (spool {mine[:12]}; the ledger holds "
            f"attempt {info['attempt']} of host {info['host']} from spool {theirs[:12]}): a new "
            "training under the id of a run already ingested, or a writer restarted in its "
            "attempt after its spool was removed; the ledger keeps the first (resume the run "
            "as a new attempt, or choose another run id)")


def _quarantine(cur, result: IngestResult, rel: str, st, reason: str) -> None:
    cur.execute(
        "INSERT OR REPLACE INTO quarantine (path, bytes, mtime_ns, reason) VALUES (?, ?, ?, ?)",
        [rel, st.st_size, st.st_mtime_ns, reason],
    )
    result.quarantined.append((rel, reason))


def _ingest_batch(ledger: Ledger, cur, agg: Aggregates, pool: ThreadPoolExecutor,
                  batch: list[_File], result: IngestResult,
                  integrity: IngestIntegrity | None) -> list[tuple[int, pa.Table]]:
    """The batch in one transaction. A file that repeats steps already ingested from another
    file, whose keys the live state cannot hold, or whose run or attempt metadata contradicts
    the ledger is quarantined, and the rest go in without it. Returns the segment files that
    went in, by file id."""
    for f, reason in _refused(cur, agg, batch):
        _quarantine(cur, result, f.item.rel, f.stat, reason)
        batch = [g for g in batch if g is not f]
    while batch:
        try:
            committed = _write_batch(ledger, cur, agg, pool, batch, integrity)
        except _Rejected as r:
            _quarantine(cur, result, r.file.item.rel, r.file.stat, str(r))
            batch = [f for f in batch if f is not r.file]
            continue
        result.files += len(batch)
        result.rows += sum(f.table.num_rows for f in batch)
        return committed
    return []


def _write_batch(ledger: Ledger, cur, agg: Aggregates, pool: ThreadPoolExecutor,
                 batch: list[_File], integrity: IngestIntegrity | None
                 ) -> list[tuple[int, pa.Table]]:
    cur.execute("BEGIN TRANSACTION")
    committed = False
    try:
        # Runs and attempts first: a contradiction rejects its file before any row goes in,
        # and a new attempt's lineage change is recomputed from the rows already committed.
        known: dict[tuple, int] = {}
        for f in batch:
            i = f.info
            key = (i["run_id"], i["fingerprint"], i["attempt"], i["resumed_from_step"],
                   i["host_count"], i["writer_version"], i["records_per_epoch"],
                   i["checkpoint_dir"], i["content_basis"])
            if key not in known:
                try:
                    run = ledger.ensure_run(cur, i["run_id"], i["fingerprint"],
                                            i["content_basis"])
                    cuts = agg.cuts(cur, run)
                    ledger.ensure_attempt(cur, run, i["attempt"], i["resumed_from_step"],
                                          i["host_count"], i["writer_version"],
                                          i["records_per_epoch"], i["checkpoint_dir"])
                except ValueError as exc:
                    raise _Rejected(f, str(exc)) from None
                agg.lineage(cur, run, cuts)
                known[key] = run
            f.run = known[key]
        ids = [r[0] for r in cur.execute("SELECT nextval('file_ids') FROM range(?)",
                                         [len(batch)]).fetchall()]
        segs = [(f, fid) for f, fid in zip(batch, ids, strict=True) if f.item.kind == "seg"]
        parts: dict[int, list[Starts]] = {}
        for run in {f.run for f, _ in segs}:
            cuts = agg.cuts(cur, run)
            parts[run] = [f.starts.before(cuts[f.info["attempt"]]) for f, _ in segs
                          if f.run == run]

        # The rows insert (DuckDB, GIL released) while this thread works out the aggregates.
        rows = pool.submit(_insert_rows, cur, batch, ids)
        index = None if integrity is None else integrity.ready()
        try:
            incs = {run: agg.increments(run, p) for run, p in parts.items()}
            checked = [] if index is None else integrity.check_files(index, [
                (fid, f.run, segment_columns(f.table), f.info["fingerprint"],
                 f.info["content_basis"]) for f, fid in segs])
        finally:
            rows.result()
        if index is not None:
            integrity.record(cur, index, checked)

        if segs:
            # Each file's run, attempt and id repeated over its steps, once for the batch (three
            # columns a file were ~75 us of it: a backfill of small files pays it per file).
            lengths = [len(f.steps) for f, _ in segs]

            def each(values: list[int]) -> pa.Array:
                return pa.array(np.repeat(np.array(values, np.int32), lengths))

            cur.register("incoming_steps", pa.concat_tables([f.steps for f, _ in segs])
                         .append_column("run", each([f.run for f, _ in segs]))
                         .append_column("attempt", each([f.info["attempt"] for f, _ in segs]))
                         .append_column("file_id", each([fid for _, fid in segs])))
            cur.execute("""INSERT INTO agg_steps SELECT run, attempt, host, step,
                n_tokens_count, n_tokens_sum, start_sum, file_id FROM incoming_steps""")
            cur.unregister("incoming_steps")
        for run, inc in incs.items():
            fids = [fid for f, fid in segs if f.run == run]
            agg.add(cur, run, inc, seg_files=len(parts[run]), files=(min(fids), max(fids)))
        cols = ("file_id", "path", "kind", "run", "attempt", "host", "first_step", "last_step",
                "n_rows", "n_tokens", "bytes", "mtime_ns", "footer_hash", "spool_id")
        rows_of = [(fid, f.item.rel, f.item.kind, f.run, f.info["attempt"], f.info["host"],
                    f.info["first_step"], f.info["last_step"], f.table.num_rows, f.n_tokens,
                    f.stat.st_size, f.stat.st_mtime_ns, f.info["footer_hash"],
                    f.info["spool_id"]) for f, fid in zip(batch, ids, strict=True)]
        cur.register("incoming_segments", pa.table(
            {c: pa.array([r[i] for r in rows_of], pa.uint64() if c == "footer_hash" else None)
             for i, c in enumerate(cols)}))
        names = ", ".join(cols)
        cur.execute(f"INSERT INTO segments ({names}) SELECT {names} FROM incoming_segments")
        cur.unregister("incoming_segments")
        for f in batch:
            if f.held:
                cur.execute("DELETE FROM quarantine WHERE path = ?", [f.item.rel])
        with agg.lock:  # readers of the per-record state open their snapshot under it
            agg.reserve()  # memory for the new state first: nothing may fail after COMMIT
            cur.execute("COMMIT")
            committed = True
            agg.version = max(agg.version, *ids)
            agg.commit()
    except BaseException:
        if committed:  # the ledger has the batch; the state in memory is rebuilt from it
            agg.invalidate(ledger)
        else:
            agg.discard()
            cur.execute("ROLLBACK")
        raise
    return [(fid, f.table) for f, fid in segs]


def _refused(cur, agg: Aggregates, batch: list[_File]) -> list[tuple[_File, str]]:
    """Files of the batch to quarantine before its transaction, with the reason.

    - A file of another spool than the one the ledger (or an earlier file of this batch) holds
      its run, attempt and host from (`_reused`): a run id reused after its spool was removed,
      whatever the file's steps (the new training's later files would otherwise be appended to
      the old run).
    - The same consumption twice (tally.audit.hook.spool.first_repeat): a host's (attempt, step,
    row)
      of a segment file, or (attempt, step, metric name) of a metric file, already ingested
      from another file or held by an earlier file of this batch. A copy under another
      sequence number, a link to a copy, or a writer restarted within its attempt would
      otherwise count rows twice.
    - A record key the live state cannot hold within its memory bound.
    """
    out: list[tuple[_File, str]] = []
    kept: dict[tuple, list[_File]] = {}
    overlapping = _overlapping(cur, batch)
    spools = _spools(cur, batch)
    budget = agg.budget(cur)  # the process's state bound, over the files taken in order
    for n, f in enumerate(batch):
        i = f.info
        key = (i["run_id"], i["attempt"], i["host"], f.item.kind)
        why = _reused(i, spools.get(key[:3]), "a file of another spool")
        if why is None:
            why = _already(cur, f, overlapping.get(n, []))
        for other in kept.get(key, []):
            if why is None and i["first_step"] <= other.info["last_step"] and \
                    other.info["first_step"] <= i["last_step"]:
                why = _repeat(f, other.table, other.item.rel, other.info["footer_hash"])
        if why is None and f.item.kind == "seg" and len(f.table):
            why = budget.refuse(i["run_id"], int(pc.max(f.table["record_key"]).as_py()))
        if why is not None:
            out.append((f, why))
            continue
        kept.setdefault(key, []).append(f)
        if i["spool_id"] is not None:
            spools.setdefault(key[:3], i["spool_id"])
    return out


def _spools(cur, batch: list[_File]) -> dict[tuple, str]:
    """The spool id the ledger holds each (run id, attempt, host) of the batch from: that of
    its first file that has one."""
    keys = sorted({(f.info["run_id"], f.info["attempt"], f.info["host"]) for f in batch
                   if f.info["spool_id"] is not None})
    if not keys:
        return {}
    cur.register("incoming_hosts", pa.table({
        "run_id": [k[0] for k in keys], "attempt": pa.array([k[1] for k in keys], pa.int64()),
        "host": pa.array([k[2] for k in keys], pa.int64())}))
    try:
        found = cur.execute("""
            SELECT i.run_id, i.attempt, i.host, arg_min(g.spool_id, g.file_id)
            FROM incoming_hosts i JOIN runs r ON r.run_id = i.run_id
            JOIN segments g ON g.run = r.run AND g.attempt = i.attempt AND g.host = i.host
            WHERE g.spool_id IS NOT NULL GROUP BY ALL""").fetchall()
    finally:
        cur.unregister("incoming_hosts")
    return {(run_id, attempt, host): spool for run_id, attempt, host, spool in found}


def _overlapping(cur, batch: list[_File]) -> dict[int, list[tuple[int, str, int | None]]]:
    """For each file of the batch (by position), the ledger's files of its run, attempt, host
    and kind whose step ranges overlap its own: one query for the batch (one a file cost ~8 ms,
    6 s of a 10M-row backfill of 128 hosts' files on this box)."""
    if not batch:
        return {}
    cur.register("incoming_ranges", pa.table({
        "n": pa.array(range(len(batch)), pa.int64()),
        "run_id": [f.info["run_id"] for f in batch],
        "attempt": pa.array([f.info["attempt"] for f in batch], pa.int64()),
        "host": pa.array([f.info["host"] for f in batch], pa.int64()),
        "kind": [f.item.kind for f in batch],
        "first_step": pa.array([f.info["first_step"] for f in batch], pa.int64()),
        "last_step": pa.array([f.info["last_step"] for f in batch], pa.int64())}))
    try:
        found = cur.execute("""
            SELECT i.n, g.file_id, g.path, g.footer_hash FROM incoming_ranges i
            JOIN runs r ON r.run_id = i.run_id
            JOIN segments g ON g.run = r.run AND g.attempt = i.attempt AND g.host = i.host
              AND g.kind = i.kind AND g.first_step <= i.last_step AND g.last_step >= i.first_step
            ORDER BY i.n, g.file_id""").fetchall()
    finally:
        cur.unregister("incoming_ranges")
    out: dict[int, list[tuple[int, str, int | None]]] = {}
    for n, file_id, path, footer in found:
        out.setdefault(n, []).append((file_id, path, footer))
    return out


def _already(cur, f: _File, overlapping: list[tuple[int, str, int | None]]) -> str | None:
    """Why `f` repeats a file already in the ledger (None: it does not). Files are compared by
    step range first (`_overlapping`); rows only where ranges overlap."""
    kind = f.item.kind
    for file_id, path, footer in overlapping:
        table = "consumption" if kind == "seg" else "metrics"
        column = '"row"' if kind == "seg" else "name"
        got = cur.execute(f"SELECT step, {column} AS other FROM {table} WHERE file_id = ?",
                          [file_id]).fetchnumpy()
        theirs = pa.table({"step": got["step"], column.strip('"'): got["other"]})
        why = _repeat(f, theirs, path, footer)
        if why is not None:
            return why
    return None


def _repeat(f: _File, theirs: pa.Table, path: str, footer: int | None) -> str | None:
    """Why `f` repeats a consumption of `theirs` (another file's step and row, or step and
    metric name, columns; `footer` its footer hash), or None."""
    if f.item.kind == "seg":
        mine_rows, their_rows = f.table["row"].to_numpy(), theirs["row"].to_numpy()
    else:  # metric names as codes shared by both sides
        names = pa.chunked_array([f.table["name"].cast(pa.string()),
                                  theirs["name"].cast(pa.string())]).combine_chunks()
        codes = pc.index_in(names, pc.unique(names)).to_numpy()
        mine_rows, their_rows = codes[: len(f.table)], codes[len(f.table):]
    both = sp.first_repeat(f.table["step"].to_numpy(), mine_rows, theirs["step"].to_numpy(),
                           their_rows)
    if both is None:
        return None
    step, row = both
    said = f"row {row} of step {step}" if f.item.kind == "seg" else f"a metric at step {step}"
    how = ("this file is a copy of it" if footer == f.info["footer_hash"] else
           "by another file: a writer restarted within its attempt, or its run id reused")
    return (f"duplicate: {said} of host {f.info['host']}, attempt {f.info['attempt']} was "
            f"already ingested from {path} ({how}); counted once, from that file")


def _insert_rows(cur, batch: list[_File], ids: list[int]) -> None:
    """The batch's rows, one INSERT a kind: the files' chunks side by side with their run,
    attempt and file id columns. One INSERT a file cost 2.6x as much for 128 hosts' files of
    ~13k rows (7.8M rows: 4.5 s against 1.7 s on this box). Their schemas are the contract's
    exactly (tally.audit.hook.spool.read_checked)."""
    for kind, (table, columns) in (("seg", ("consumption", SEGMENT_COLUMNS_ALL)),
                                   ("met", ("metrics", METRIC_COLUMNS))):
        files = [(f, fid) for f, fid in zip(batch, ids, strict=True) if f.item.kind == kind]
        if not files:
            continue
        data = {c.name: pa.chunked_array([k for f, _ in files for k in f.table[c.name].chunks],
                                         c.arrow) for c in columns}
        for name, of in (("run", lambda f, _: f.run), ("attempt", lambda f, _: f.info["attempt"]),
                         ("file_id", lambda _, fid: fid)):
            data[f"_{name}"] = pa.chunked_array(
                [np.full(f.table.num_rows, of(f, fid), np.int32) for f, fid in files], pa.int32())
        cur.register("incoming", pa.table(data))
        cur.execute(f"INSERT INTO {table} SELECT _run, _attempt, {sql_select(columns)}, _file_id "
                    "FROM incoming")
        cur.unregister("incoming")
