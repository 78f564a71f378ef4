"""Aggregates kept at ingest, so that live queries never scan `consumption`.

Two layers:
- the `agg_*` tables of the ledger (schema in audit/ledger/database.py), written in the same
  transaction as the segment files they count, so a reader sees a file's effect entirely or not
  at all;
- per-record state (audit/ledger/state.py) in memory, restored from its snapshot or rebuilt by
  replaying the ledger's segment files in file id order when a process first ingests.

From the per-record state, each batch of files changes only what it touches: the step at which
a record was first, second and third seen (`agg_ranks`: coverage and the 0/1/2/3+ histogram as
of any step), how many records sit at each exposure level (`agg_levels`: excess over ideal), the
host x host overlap (`agg_host_pairs`, `agg_hosts`) and run totals (`agg_runs`). Per-step and
per-host counts (`agg_steps`) keep every row with its attempt; readers leave out rolled-back
steps.

Restart lineage: an attempt's rows at or after its `rolled_back_from_step` stay out of the
per-record state. When a new attempt lowers a cut, the records with rows that just left the
lineage are recomputed from `effective_consumption` and the differences written.

Readers of the per-record state take `Aggregates.lock` while they pin their snapshot: the
ingester holds it across each COMMIT and the state update that goes with it
(tally.audit.ledger.live).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import duckdb
import numpy as np
import pyarrow as pa

from tally.audit.core.arrays import host_overlap, ranks, spans
from tally.audit.core.exposure import effective_sql, start_sql
from tally.audit.ledger.database import Ledger, one
from tally.audit.ledger.snapshot import Applied, Invalid, Snapshots, lowered_cuts
from tally.audit.ledger.state import (
    COMPACT,
    NO_STEP,
    SETTLED,
    Once,
    Records,
    RunState,
    Starts,
    csr,
    grouped,
)

log = logging.getLogger("tally.state")
CATCH_UP_ROWS = 8_000_000  # consumption rows read at a time when a snapshot catches up
# The process's aggregates in use (one a ledger it has open): TALLY_MAX_STATE_GB bounds the
# rows of all their runs together. A bound per run let three runs of 4 rows, each with one
# large key, hold 2.9 GB of state (and of snapshots) under TALLY_MAX_STATE_GB=1.
_LIVE: weakref.WeakSet[Aggregates] = weakref.WeakSet()
_LIVE_LOCK = threading.Lock()  # a reader's reload may add one while the ingester counts


@dataclass
class Deltas:
    """What changed between two states of the same records, ready for the agg tables."""

    ranks: tuple[np.ndarray, np.ndarray, np.ndarray]  # rank, step, records
    levels: tuple[np.ndarray, np.ndarray]  # level, records
    pairs: tuple[np.ndarray, np.ndarray, np.ndarray]  # a, b, records
    shared: tuple[np.ndarray, np.ndarray]  # host, records
    totals: list[int]  # records, exposures, epoch duplicates, their records, multi-host


@dataclass
class Increment:
    """A batch's effect on one run, worked out before its rows are in the ledger."""

    new: Records  # the new state of the records the batch touches (but `once`'s)
    deltas: Deltas
    late: np.ndarray  # bool per record of `new`: a start below the watermark (ranks later)
    seen: list[tuple[int, int, int, int | None]]  # (attempt, host, hosts, last step) per file
    once: Once  # the records started once, the short way (RunState.once)


@dataclass
class _Staged:
    """A change to a run's state, applied at commit."""

    run: int
    new: Records
    seen: list[tuple[int, int, int, int | None]]
    lower: int | None = None  # a restart's watermark
    once: Once | None = None


class Aggregates:
    """The aggregates of one open ledger, for the one process that ingests into it.

    Writes happen inside the caller's transaction; `commit()` (under `lock`, right after the
    COMMIT) publishes the per-record state, `discard()` drops it after a ROLLBACK. Readers of
    the per-record state take `lock` while they open their snapshot.
    """

    def __init__(self, max_state_bytes: int | None = None) -> None:
        self.runs: dict[int, RunState] = {}
        self.lock = threading.Lock()
        self.ingesting = threading.Lock()  # held by tally.audit.ledger.ingest for a whole call
        self._pending: list[_Staged] = []
        self.max_state_bytes = max_state_bytes or default_max_state_bytes()
        self.snapshots: Snapshots | None = None  # set by load() for a ledger on disk
        # The newest file id committed: the ledger's version, as a snapshot's max(file_id)
        # (tally.audit.ledger.live answers a cached request by it, without opening a snapshot).
        self.version = 0
        self.dropped = False  # invalidated or its ledger closed: no longer counted
        with _LIVE_LOCK:
            _LIVE.add(self)

    # ---- loading ---------------------------------------------------------------------------
    @classmethod
    def load(cls, ledger: Ledger, *, use_snapshots: bool = True) -> Aggregates:
        """Per-record state from the ledger: each run's from its snapshot (tally.audit.ledger.
        snapshot) caught up with the files ingested after it, or rebuilt from
        `effective_consumption` where there is no usable snapshot (why, logged once per run).
        Agg tables rebuilt for runs whose tables do not cover every ingested segment file (a
        ledger filled before the tables existed)."""
        agg = cls()
        agg.snapshots = Snapshots(ledger.path, ledger.ledger_id)
        cur = ledger.cursor()
        try:
            agg.version = one(cur, "SELECT coalesce(max(file_id), 0) FROM segments")[0]
            counts = dict(cur.execute("""
                SELECT run, count(*) FROM segments WHERE kind = 'seg' GROUP BY ALL""").fetchall())
            names = dict(cur.execute("SELECT run, run_id FROM runs").fetchall())
            rebuild: dict[int, str] = {}
            for run in sorted(counts):
                try:
                    if not use_snapshots:
                        raise Invalid("snapshots not used")
                    agg._restore(cur, run, names[run])
                except Invalid as why:
                    rebuild[run] = str(why)
            for run, why in rebuild.items():
                t0 = time.monotonic()
                agg.runs[run] = RunState()
                rows = agg._catch_up(cur, run, None)
                if use_snapshots:
                    log.warning("run %s: per-record state rebuilt from the ledger (%s): %s rows "
                                "in %.2f s", names[run], why, f"{rows:,}", time.monotonic() - t0)
            for run in counts:
                agg._state(run)  # a run with no exposure yet has a state (and a snapshot) too
            applied = dict(cur.execute("SELECT run, seg_files FROM agg_runs").fetchall())
            for run, n in counts.items():
                if applied.get(run) != n:
                    agg._rebuild_tables(cur, run, n)
        finally:
            cur.close()
        return agg

    def _restore(self, cur: duckdb.DuckDBPyConnection, run: int, run_id: str) -> None:
        """The run's state from its snapshot, caught up with the ledger (Invalid: no usable
        snapshot)."""
        t0 = time.monotonic()
        snap = self.snapshots.open(cur, run, run_id, COMPACT)
        st = self.runs[run] = RunState.over(snap.rows, snap.top)
        try:
            try:
                st.restore_extra(snap.extra)
            except (KeyError, ValueError, TypeError) as exc:  # checksummed, yet not ours
                raise Invalid(f"unreadable snapshot maps ({type(exc).__name__}: {exc})"
                              ) from None
            rows = self._catch_up(cur, run, snap.applied)
        except BaseException:
            del self.runs[run]
            raise
        self.snapshots.restored(run, snap.applied)
        log.info("run %s: per-record state restored from its snapshot (%s records) and %s rows "
                 "ingested after it in %.2f s", run_id, f"{st.size:,}", f"{rows:,}",
                 time.monotonic() - t0)

    def _catch_up(self, cur: duckdb.DuckDBPyConnection, run: int, since: Applied | None
                  ) -> int:
        """Apply to the run's state what the ledger holds beyond `since` (what a snapshot
        covers): first the records whose rows left the lineage since, recomputed as of the
        snapshot's files, then the record starts of later segment files in file id order, as
        the ingest applied them. Returns the rows read.

        `since` None: from nothing, a rebuild of a fresh state: every file replayed in file id
        order, the order the ingest applied them in, its rows cut to today's lineage, and the
        watermark lowered to where each new attempt resumed, at its first file, as its ingest
        did. Memory and disk stay bounded by CATCH_UP_ROWS: one aggregate over the ledger's
        rows (each record's host and epoch lists) spilled more than 40 GB at 500M rows."""
        st = self.runs[run]
        if since is not None:
            lowered = lowered_cuts(since.lineage, self.cuts(cur, run))
            if lowered:
                keys = _rolled_back_keys(cur, run, lowered)
                new = _ledger_records(cur, [run], keys, upto=since.max_file_id).get(run)
                st.lower(min(st.watermark, min(cut for _, cut, _ in lowered)))
                st.put(_complete(keys, new))
        files = cur.execute("""SELECT s.file_id, s.n_rows, s.host, s.attempt, s.last_step,
                a.host_count, a.resumed_from_step FROM segments s JOIN attempts a
                USING (run, attempt)
            WHERE s.run = ? AND s.kind = 'seg' AND s.file_id > ? ORDER BY s.file_id""",
                            [run, 0 if since is None else since.max_file_id]).fetchnumpy()
        ids, sizes = np.asarray(files["file_id"], np.int64), np.asarray(files["n_rows"], np.int64)
        meta = {int(f): (int(h), int(a), int(s), int(c)) for f, h, a, s, c in zip(
            ids, files["host"], files["attempt"], files["last_step"], files["host_count"],
            strict=True)}
        # File id ranges of about CATCH_UP_ROWS rows each bound the memory of a long catch-up;
        # consumption is in file id order, so each range reads few row groups.
        cuts = np.searchsorted(np.cumsum(sizes), np.arange(1, 1 + sizes.sum() // CATCH_UP_ROWS)
                               * CATCH_UP_ROWS) + 1
        resumes: dict[int, int] = {}  # a rebuild: the index of each resumed attempt's first file
        if since is None:
            attempt = np.asarray(files["attempt"], np.int64)
            for _, i in zip(*np.unique(attempt, return_index=True), strict=True):
                cut = files["resumed_from_step"][i]
                if cut is not None and not np.ma.is_masked(cut) and i > 0:
                    resumes[int(i)] = int(cut)
        at = np.unique(np.r_[np.minimum(cuts, len(ids)), list(resumes)]).astype(np.int64)
        for first, part in zip(np.r_[0, at].tolist(), np.split(ids, at), strict=True):
            if first in resumes:
                st.lower(min(st.watermark, resumes[first]))
            if not len(part):
                continue
            got = cur.execute(f"""SELECT record_key, step, epoch, file_id
                FROM effective_consumption WHERE run = ? AND file_id BETWEEN ? AND ?
                AND {start_sql()} ORDER BY file_id""",
                              [run, int(part[0]), int(part[-1])]).fetchnumpy()
            fid = np.asarray(got["file_id"], np.int64)
            keys, steps = np.asarray(got["record_key"], np.int64), np.asarray(got["step"],
                                                                                np.int64)
            epochs = np.asarray(got["epoch"], np.int64)
            parts = []
            for f in part.tolist():
                a, b = np.searchsorted(fid, [f, f + 1])
                host, attempt, last, hosts = meta[f]
                parts.append(Starts(keys[a:b], steps[a:b], epochs[a:b], host, attempt, last,
                                    hosts))
            inc = _increment(parts, st.watermark, st.get, st)
            if inc.late.any():
                self._settle_late(cur, run, inc, int(part[0]), int(part[-1]))
            for seen in inc.seen:
                st.observe(*seen)
            st.advance()
            st.put(inc.new)
            st.put_once(inc.once)
            st.settle()
        return int(sizes.sum())

    # ---- snapshots -------------------------------------------------------------------------
    def save(self, ledger: Ledger, *, final: bool = False) -> None:
        """Write the snapshots that are due (tally.audit.ledger.snapshot.Snapshots.due); `final` on
        a
        clean end of the process. Waits for the ingest under way."""
        with self.ingesting:
            self.save_locked(ledger, final=final)

    def save_locked(self, ledger: Ledger, *, final: bool = False) -> None:
        """`save` for a caller that holds `ingesting`: the state cannot change meanwhile, so
        the rows are written from where they are (no copy). Readers go on throughout: they
        never write the state, and `lock` is not taken."""
        if self.snapshots is None or ledger._aggregates is not self:
            return  # dropped (invalidate): the ledger's next user reloads it
        cur = ledger.cursor()
        try:
            names = dict(cur.execute("SELECT run, run_id FROM runs").fetchall())
            for run, st in list(self.runs.items()):
                applied = self.snapshots.due(cur, run, final=final)
                if applied is not None:
                    rows = min(st.size, st.top + 1)
                    self.snapshots.write(run, names[run], st.data[:rows], st.top, applied,
                                         st.extra())
        finally:
            cur.close()

    def _state(self, run: int) -> RunState:
        return self.runs.setdefault(run, RunState())

    def _rebuild_tables(self, cur: duckdb.DuckDBPyConnection, run: int, files: int) -> None:
        cur.execute("BEGIN TRANSACTION")
        try:
            for t in ("agg_steps", "agg_ranks", "agg_levels", "agg_host_pairs", "agg_hosts",
                      "agg_runs"):
                cur.execute(f"DELETE FROM {t} WHERE run = ?", [run])
            cur.execute(f"""
                INSERT INTO agg_steps SELECT run, attempt, host, step, count(*), sum(n_tokens),
                    count(*) FILTER (WHERE {start_sql()}), file_id
                FROM consumption WHERE run = ? GROUP BY ALL""", [run])
            # Ranks straight from the ledger (the state keeps only the pending steps).
            cur.execute(f"""
                INSERT INTO agg_ranks SELECT run, rank, step, count(*) FROM (
                    SELECT run, unnest(e) AS step, generate_subscripts(e, 1) AS rank
                    FROM (SELECT run, record_key, min(step, 3) AS e FROM effective_consumption
                          WHERE run = ? AND {start_sql()} GROUP BY ALL))
                GROUP BY ALL""", [run])
            st = self._state(run)
            new = st.get(st.seen())
            new.steps[:] = NO_STEP
            write_deltas(cur, run, deltas(Records.empty(new.keys), new), seg_files=files)
            cur.execute("COMMIT")
        except BaseException:
            cur.execute("ROLLBACK")
            raise

    # ---- ingest hooks (inside the batch's transaction) --------------------------------------
    @staticmethod
    def cuts(cur: duckdb.DuckDBPyConnection, run: int) -> dict[int, int | None]:
        return dict(cur.execute("SELECT attempt, rolled_back_from_step FROM attempts "
                                "WHERE run = ?", [run]).fetchall())

    def lineage(self, cur: duckdb.DuckDBPyConnection, run: int,
                before: dict[int, int | None]) -> None:
        """Take out of the per-record state the rows that a new attempt just rolled back, and
        lower the watermark to where they begin (the new attempt's rows start there). Call it
        before the batch inserts any row: the recomputation reads `consumption`."""
        lowered = lowered_cuts(before, self.cuts(cur, run))
        if not lowered:
            return
        lower = min(cut for _, cut, _ in lowered)
        keys = _rolled_back_keys(cur, run, lowered)
        old = _complete(keys, _ledger_records(cur, [run], keys, cuts=before).get(run))
        new = _complete(keys, _ledger_records(cur, [run], keys).get(run))
        if len(keys):
            write_deltas(cur, run, deltas(old, new), seg_files=0)
        self._pending.append(_Staged(run, new, [], lower))

    def increments(self, run: int, parts: list[Starts]) -> Increment:
        """The new state of the records that `parts` (starts already cut to the lineage)
        touch, and what changed: numpy only, so it can run while the batch's rows insert.
        The ranks of records with a start below the watermark are left to `add`."""
        st = self._state(run)
        w = min([st.watermark] + [s.lower for s in self._pending
                                  if s.run == run and s.lower is not None])
        staged = [s.new.keys for s in self._pending if s.run == run] + \
            [s.once.keys for s in self._pending if s.run == run and s.once is not None]
        return _increment(parts, w, lambda keys: self.get(run, keys), st,
                          np.concatenate(staged) if staged else None)

    def add(self, cur: duckdb.DuckDBPyConnection, run: int, inc: Increment, seg_files: int,
            files: tuple[int, int]) -> None:
        """Write the batch's changes (its rows are in: file ids `files`, lowest and highest)."""
        if inc.late.any():
            inc.deltas.ranks = _cat_ranks(inc.deltas.ranks,
                                          self._settle_late(cur, run, inc, *files))
        write_deltas(cur, run, inc.deltas, seg_files=seg_files)
        self._pending.append(_Staged(run, inc.new, inc.seen, once=inc.once))

    @staticmethod
    def _settle_late(cur: duckdb.DuckDBPyConnection, run: int, inc: Increment, lo: int,
                     hi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For the records with a start below the watermark (files `lo`..`hi` in the ledger):
        their three earliest steps before and after those files, from the ledger; `inc.new`
        takes the latter. Returns the rank changes."""
        idx = np.flatnonzero(inc.late)
        keys = inc.new.keys[idx]
        before = _complete(keys, _ledger_records(cur, [run], keys, upto=lo - 1).get(run))
        after = _complete(keys, _ledger_records(cur, [run], keys, upto=hi).get(run))
        inc.new.steps[idx] = after.steps
        return _rank_deltas(before.steps, after.steps)

    def state_bytes(self) -> int:
        """The bytes of every run's rows (their capacity): what TALLY_MAX_STATE_GB counts.
        The rows are dense by key; the maps beside them grow with the rows ingested, as the
        ledger does, and are not counted."""
        return sum(st.data.nbytes for st in list(self.runs.values()))

    def budget(self, cur: duckdb.DuckDBPyConnection) -> StateBudget:
        """The state's bound over one batch's files (tally.audit.ledger.ingest, before the batch's
        transaction)."""
        rows = {name: self.runs[run].size for run, name in cur.execute(
            "SELECT run, run_id FROM runs").fetchall() if run in self.runs}
        return StateBudget(self.max_state_bytes, process_state_bytes(), rows)

    def reserve(self) -> None:
        """Grow the state for the pending changes (before the COMMIT: what can fail, such as
        an allocation, fails while the transaction can still roll back). Room to grow into
        stops at the bound (StateBudget let the keys in). Each run's `top` is raised here
        too, before the COMMIT that adds its keys: a reader that checks it without the lock
        (tally.audit.ledger.live) never misses keys its snapshot holds (it was raised by the
        state's update after the COMMIT, a window in which such a reader left them out)."""
        total = process_state_bytes()
        for s in self._pending:
            top = max([int(k[-1]) for k in (s.new.keys, None if s.once is None else s.once.keys)
                       if k is not None and len(k)], default=-1)
            if top >= 0:
                st = self._state(s.run)
                before = st.data.nbytes
                st.reserve(top + 1, most=(self.max_state_bytes - total + before)
                           // COMPACT.itemsize)
                st.top = max(st.top, top)
                total += st.data.nbytes - before

    def commit(self) -> None:
        # A restart's lower watermark first, then the files' hosts (the watermark rises
        # before the records go in, so that their steps below it never enter the pending
        # table), then the records, then the pending steps the new watermark settles.
        touched = {s.run for s in self._pending}
        for s in self._pending:
            st = self._state(s.run)
            if s.lower is not None:
                st.lower(min(st.watermark, s.lower))
            for seen in s.seen:
                st.observe(*seen)
        for run in touched:
            self.runs[run].advance()
        for s in self._pending:
            self.runs[s.run].put(s.new)
            if s.once is not None:
                self.runs[s.run].put_once(s.once)
        for run in touched:
            self.runs[run].settle()
        self._pending = []

    def discard(self) -> None:
        self._pending = []

    def invalidate(self, ledger: Ledger) -> None:
        """The state no longer matches the ledger (or the ledger is closing): the next user
        reloads it from the ledger, and it no longer counts against the process's bound."""
        self._pending = []
        self.dropped = True
        if ledger._aggregates is self:
            ledger._aggregates = None

    def get(self, run: int, keys: np.ndarray) -> Records:
        """State as this transaction sees it: committed, then this transaction's changes."""
        out = self._state(run).get(keys)
        for s in self._pending:
            if s.run == run:
                out = out.overlay(s.new)
                if s.once is not None and len(s.once):
                    out = out.overlay(s.once.records())
        return out


def process_state_bytes() -> int:
    """The rows of the per-record state of every ledger this process has open."""
    with _LIVE_LOCK:
        live = list(_LIVE)
    return sum(a.state_bytes() for a in live if not a.dropped)


def _size(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 / 10 else f"{n / 2**20:,.1f} MiB"


class StateBudget:
    """TALLY_MAX_STATE_GB over the files of one batch, taken in order: the rows of the
    per-record state of the whole process (every run of every open ledger), with the rows the
    files taken before need, stay within the bound. The state is dense by key (8 bytes a key
    up to the largest), so a file's largest key sets its run's rows; the bound keeps files
    from exhausting memory, and the snapshots on disk, which hold no more than those rows."""

    def __init__(self, limit: int, total: int, rows: dict[str, int]) -> None:
        self.limit = limit
        self.total = total  # bytes of the process's state, with what the batch adds
        self.rows = rows  # run id -> its rows (capacity), with what the batch adds

    def refuse(self, run_id: str, key: int) -> str | None:
        """Why a file of run `run_id` whose largest record key is `key` cannot go in (None:
        it can, and its rows are counted for the files after it)."""
        have = self.rows.get(run_id, 0)
        if key < have:
            return None
        need = (key + 1) * COMPACT.itemsize
        others = self.total - have * COMPACT.itemsize
        if need > self.limit:
            return (f"record_key {key:,} would need {_size(need)} of live state, more than "
                    f"the {_size(self.limit)} this process allows (TALLY_MAX_STATE_GB)")
        if others + need > self.limit:
            return (f"record_key {key:,} would need {_size(need)} of live state, and the "
                    f"process's other runs hold {_size(others)}: more than the "
                    f"{_size(self.limit)} this process allows in all (TALLY_MAX_STATE_GB)")
        self.total = others + need
        self.rows[run_id] = key + 1
        return None


def default_max_state_bytes() -> int:
    """Half the machine's memory, or TALLY_MAX_STATE_GB: for the whole process."""
    gb = os.environ.get("TALLY_MAX_STATE_GB")
    if gb:
        return int(float(gb) * 2**30)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def for_ledger(ledger: Ledger) -> Aggregates:
    """The ledger's aggregates, loaded on first use by this process."""
    agg = ledger._aggregates
    if agg is None:
        agg = Aggregates.load(ledger)
        ledger._aggregates = agg
    return agg


def _increment(parts: list[Starts], watermark: int, get: Callable[[np.ndarray], Records],
               state: RunState | None = None, exclude: np.ndarray | None = None) -> Increment:
    """What `parts` change, given the state before them (`get`; `state`'s rows for the
    records that take the short way, RunState.once, but those in `exclude`)."""
    g = grouped(parts)
    once = Once.empty()
    if state is not None:
        mine, once = state.once(g, watermark, exclude)
    inc = g.records(np.flatnonzero(~mine) if len(once) else None)
    old = get(inc.keys)
    new = old.merged(inc)
    late = inc.steps[:, 0] < watermark
    if late.any():  # their ranks come from the ledger once the batch's rows are in
        new.steps[late] = old.steps[late]
    seen = [(p.attempt, p.host, p.host_count, p.last_step) for p in parts]
    d = deltas(old, new)
    if len(once):
        d = _sum_deltas(d, once_deltas(once))
    return Increment(new, d, late, seen, once)


def _complete(keys: np.ndarray, found: Records | None) -> Records:
    """Records for every key of `keys` (sorted): `found`'s, else never seen."""
    out = Records.empty(keys)
    return out if found is None else out.overlay(found)


def _rolled_back_keys(cur: duckdb.DuckDBPyConnection, run: int,
                      lowered: list[tuple[int, int, int | None]]) -> np.ndarray:
    """The record keys (sorted) with starts at steps that just left the lineage: attempt a's
    steps from its new cut up to its old one (`snapshot.lowered_cuts`)."""
    clauses = " OR ".join("(attempt = ? AND step >= ?" + (" AND step < ?)" if old is not None
                                                          else ")")
                          for _, _, old in lowered)
    params = [run] + [x for a, cut, old in lowered
                      for x in ((a, cut) if old is None else (a, cut, old))]
    keys = cur.execute(f"""SELECT DISTINCT record_key FROM consumption
        WHERE run = ? AND {start_sql()} AND ({clauses})""", params).fetchnumpy()["record_key"]
    return np.sort(np.asarray(keys, np.int64))


LEDGER_BATCH = 1 << 22  # records a batch when the state is read from the ledger


def _ledger_records(cur: duckdb.DuckDBPyConnection, runs: list[int] | None = None,
                    keys: np.ndarray | None = None, *, upto: int | None = None,
                    cuts: dict[int, int | None] | None = None) -> dict[int, Records]:
    """Per-record state straight from the ledger (`_ledger_batches`), each run's in one."""
    out: dict[int, list[Records]] = {}
    for run, rec in _ledger_batches(cur, runs, keys, upto=upto, cuts=cuts):
        out.setdefault(run, []).append(rec)
    return {run: Records.concat(parts) for run, parts in out.items()}


def _ledger_batches(cur: duckdb.DuckDBPyConnection, runs: list[int] | None = None,
                    keys: np.ndarray | None = None, *, upto: int | None = None,
                    cuts: dict[int, int | None] | None = None) -> Iterator[tuple[int, Records]]:
    """Per-record state straight from the ledger's effective record starts: all runs, some
    runs, or some keys of one run; of the files up to file id `upto`; under the restart
    lineage `cuts` (attempt -> rolled_back_from_step of the one run) instead of the ledger's.
    Streamed in record order, LEDGER_BATCH records at a time (a rebuild of billions of
    records never holds them all)."""
    where, params = [], []
    if runs is not None:
        where.append("c.run IN (SELECT unnest(?))")
        params.append([int(r) for r in runs])
    if keys is not None:
        where.append("c.record_key IN (SELECT k FROM recompute_keys)")
        cur.register("recompute_keys", pa.table({"k": np.asarray(keys, np.int64)}))
    if upto is not None:
        where.append("c.file_id <= ?")
        params.append(int(upto))
    lineage = "attempts"
    if cuts is not None:
        cur.register("recompute_cuts", pa.table({
            "run": pa.array([runs[0]] * len(cuts), pa.int32()),
            "attempt": pa.array(list(cuts), pa.int32()),
            "rolled_back_from_step": pa.array(list(cuts.values()), pa.int64())}))
        lineage = "recompute_cuts"
    try:
        reader = cur.sql(f"""
            SELECT c.run, c.record_key, count(*) AS exposures, min(c.step, 3) AS earliest,
                   coalesce(list(DISTINCT c.host) FILTER (WHERE c.host >= 0), []) AS hosts,
                   coalesce(list(DISTINCT c.epoch) FILTER (WHERE c.epoch >= 0), []) AS epochs,
                   count(*) FILTER (WHERE c.epoch >= 0) AS epoch_exposures
            FROM consumption c JOIN {lineage} a USING (run, attempt)
            WHERE {start_sql("c")} AND {effective_sql("c", "a")}
                  {"".join(" AND " + w for w in where)}
            GROUP BY ALL ORDER BY c.run, c.record_key""", params=params).to_arrow_reader(
            LEDGER_BATCH)
        for batch in reader:
            runs_col = batch.column("run").to_numpy()
            for r in np.unique(runs_col):
                yield int(r), _records_of(batch.filter(pa.array(runs_col == r)))
    finally:
        if keys is not None:
            cur.unregister("recompute_keys")
        if cuts is not None:
            cur.unregister("recompute_cuts")


def _records_of(part: pa.RecordBatch) -> Records:
    """Records from rows of `_ledger_batches`' query."""
    n = part.num_rows
    rec = Records.empty(part.column("record_key").to_numpy().astype(np.int64))
    rec.exposures = part.column("exposures").to_numpy().astype(np.int64)
    for name, target in (("earliest", "steps"), ("hosts", "host"), ("epochs", "epoch")):
        col = part.column(name)
        off = col.offsets.to_numpy().astype(np.int64)
        vals = col.values.to_numpy(zero_copy_only=False).astype(np.int64)
        off, vals = off - off[0], vals[off[0]: off[-1]]
        if target == "steps":
            counts = np.diff(off)
            for j in range(3):
                ok = np.flatnonzero(counts > j)
                rec.steps[ok, j] = vals[off[ok] + j]
        else:
            ptr, v = csr(np.repeat(np.arange(n), np.diff(off)), vals, n)
            setattr(rec, f"{target}_ptr", ptr)
            setattr(rec, f"{target}s", v)
    rec.epoch_dups = part.column("epoch_exposures").to_numpy().astype(np.int64) - \
        rec.epoch_counts
    rec.dup = rec.epoch_dups > 0
    return rec


def _tally(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct values and how often each occurs."""
    if not len(values):
        return values.astype(np.int64), np.zeros(0, np.int64)
    lo, hi = int(values.min()), int(values.max())
    if hi - lo <= 4 * len(values) + 4096:
        c = np.bincount(values - lo)
        u = np.flatnonzero(c)
        return u + lo, c[u]
    v = np.sort(values)
    b = np.flatnonzero(np.r_[True, v[1:] != v[:-1]])
    return v[b], np.diff(np.r_[b, len(v)])


def _net(plus: np.ndarray, minus: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per distinct value: occurrences in `plus` minus occurrences in `minus`, non-zero only."""
    up, cp = _tally(plus)
    um, cm = _tally(minus)
    u, inv = np.unique(np.r_[up, um], return_inverse=True)
    d = np.bincount(inv, weights=np.r_[cp, -cm], minlength=len(u)).round().astype(np.int64)
    nz = d != 0
    return u[nz], d[nz]


def _rank_deltas(old: np.ndarray, new: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """agg_ranks changes between two [n, 3] triples of the same records (SETTLED and NO_STEP
    are no step to count: a settled rank is counted already and never moves)."""
    rk, st, rc = [], [], []
    for j in range(3):
        os_, ns = old[:, j], new[:, j]
        ch = os_ != ns
        s, d = _net(ns[ch & (ns != NO_STEP) & (ns != SETTLED)],
                    os_[ch & (os_ != NO_STEP) & (os_ != SETTLED)])
        rk.append(np.full(len(s), j + 1, np.int8))
        st.append(s)
        rc.append(d)
    return np.concatenate(rk), np.concatenate(st), np.concatenate(rc)


def _cat_ranks(a: tuple, b: tuple) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Two sets of rank changes as one (the same (rank, step) summed)."""
    rank, step, rec = (np.concatenate([x, y]) for x, y in zip(a, b, strict=True))
    if not len(rank):
        return rank, step, rec
    code = rank.astype(np.int64)
    order = np.lexsort((step, code))
    rank, step, rec = rank[order], step[order], rec[order]
    head = np.flatnonzero(np.r_[True, (rank[1:] != rank[:-1]) | (step[1:] != step[:-1])])
    total = np.add.reduceat(rec, head)
    keep = total != 0
    return rank[head][keep], step[head][keep], total[keep]


def _masks(r: Records, rows: np.ndarray) -> np.ndarray:
    """The host sets of the selected records as 64-bit masks (hosts below 64 only)."""
    counts = r.host_counts[rows]
    values = r.hosts[spans(r.host_ptr[:-1][rows], counts)]
    out = np.zeros(len(rows), np.uint64)
    some = np.flatnonzero(counts)
    if len(some):
        at = np.r_[0, np.cumsum(counts[some])[:-1]]
        out[some] = np.bitwise_or.reduceat(np.left_shift(np.uint64(1), values.astype(np.uint64)),
                                           at)
    return out


def _mask_pairs(old: Records, new: Records, ch: np.ndarray) -> tuple[tuple, tuple]:
    """Host-pair and shared-record changes of the records `ch`, for hosts below 64: by
    distinct host mask (a batch has few), each mask's records counted for every pair of hosts
    in it through one small matrix product."""
    rows = np.flatnonzero(ch)
    masks, d = _net(_masks(new, rows).view(np.int64), _masks(old, rows).view(np.int64))
    masks = masks.view(np.uint64)
    width = int(np.bitwise_or.reduce(masks)).bit_length() if len(masks) else 0
    bits = ((masks[:, None] >> np.arange(width, dtype=np.uint64)) & np.uint64(1)
            ).astype(np.float64)
    w = d.astype(np.float64)
    m = (bits.T @ (bits * w[:, None])).round().astype(np.int64)
    a, b = np.nonzero(m)
    many = np.bitwise_count(masks) >= 2
    sh = (w[many] @ bits[many]).round().astype(np.int64) if width else np.zeros(0, np.int64)
    h = np.flatnonzero(sh)
    return (a.astype(np.int32), b.astype(np.int32), m[a, b]), (h.astype(np.int32), sh[h])


def _added_pairs(small: Records, big: Records, rows: np.ndarray, hosts: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Host-pair and shared-record counts that the records `rows` gain from `small`'s host sets
    to `big`'s (each a superset of the other's): the ordered pairs with at least one added
    host, the records each added host now holds (the diagonal), and per host the records that
    become shared. Only the pairs an added host is in
    (2 |added| |kept| + |added|^2 a record) instead of all pairs of both sets: at 128 hosts, the
    ~3 hosts of a record of a multi-epoch run make that ~3x fewer."""
    ks, kb = small.host_counts[rows], big.host_counts[rows]
    s_at, b_at = small.host_ptr[:-1][rows], big.host_ptr[:-1][rows]
    s_hosts = small.hosts[spans(s_at, ks)]
    b_row = np.repeat(np.arange(len(rows)), kb)
    b_hosts = big.hosts[spans(b_at, kb)]
    # A pair of `big` is added where its (row, host) is not in `small`. Both code lists are
    # sorted (rows ascend, each record's hosts are sorted) and small's are among big's, so a
    # binary search places them (np.isin sorted both again: 23 of 62 ms a batch here).
    s_codes = np.repeat(np.arange(len(rows)), ks) * hosts + s_hosts
    b_codes = b_row * hosts + b_hosts
    added = np.ones(len(b_codes), bool)
    added[np.minimum(np.searchsorted(b_codes, s_codes), len(b_codes) - 1)] = False
    if len(s_codes) and not np.array_equal(b_codes[~added], s_codes):  # never, by the caller
        added = ~np.isin(b_codes, s_codes, assume_unique=True)
    a_row, a_host = b_row[added], b_hosts[added]
    # added x kept, both ways
    s_ptr = np.r_[0, np.cumsum(ks)]
    reps = ks[a_row]
    x = np.repeat(a_host, reps)
    y = s_hosts[spans(s_ptr[a_row], reps)]
    m = np.bincount(np.r_[x * hosts + y, y * hosts + x], minlength=hosts * hosts)
    # added x added (records with two or more added hosts), off the diagonal
    ka = np.bincount(a_row, minlength=len(rows))
    _, _, both = host_overlap(a_row, a_host, ka[a_row], hosts)
    np.fill_diagonal(both, 0)
    m = m.reshape(hosts, hosts) + both
    m[np.diag_indices(hosts)] += np.bincount(a_host, minlength=hosts)  # the diagonal: records seen
    # shared: every host of a record that becomes shared; the added hosts of one already was
    became = (ks <= 1) & (kb > 1)
    sh = np.bincount(b_hosts[became[b_row]], minlength=hosts)
    sh += np.bincount(a_host[(ks > 1)[a_row]], minlength=hosts)
    return m.astype(np.int64), sh.astype(np.int64)


def _host_ranks(old: Records, new: Records) -> tuple[np.ndarray, Records, Records]:
    """The distinct hosts of both states (sorted), and both states with each host replaced by
    its rank among them (as they are when the hosts are 0..k-1 already, the usual case)."""
    both = np.r_[old.hosts, new.hosts]
    if not len(both):
        return np.zeros(0, np.int64), old, new
    # A bincount over host numbers (contract: below 65,536, so at most 512 KiB) finds the
    # distinct hosts in one pass, where a sort of every (record, host) pair of the batch would
    # cost its n log n on the ingest's hot path.
    ids = np.flatnonzero(np.bincount(both))
    if int(ids[-1]) == len(ids) - 1:
        return ids, old, new
    return (ids, dataclasses.replace(old, hosts=ranks(ids, old.hosts)),
            dataclasses.replace(new, hosts=ranks(ids, new.hosts)))


def deltas(old: Records, new: Records) -> Deltas:
    """The agg-table changes between two states of the same records (numpy only)."""
    ranks = _rank_deltas(old.steps, new.steps)

    oe, ne = old.exposures, new.exposures
    ch = oe != ne
    levels = _net(ne[ch & (ne > 0)].astype(np.int64), oe[ch & (oe > 0)].astype(np.int64))

    pairs = (np.zeros(0, np.int32),) * 2 + (np.zeros(0, np.int64),)
    shared = (np.zeros(0, np.int32), np.zeros(0, np.int64))
    multi = 0
    ok_, nk = old.host_counts, new.host_counts
    ch = ok_ != nk  # one state's hosts hold the other's: a change adds or drops some
    if ch.any():
        # Host numbers as ranks among the hosts these records were on: the pair counts below
        # are sized by the hosts that exist, never by the host number (a 4-row file of host
        # 65,535 made this a 65,536 x 65,536 matrix, 32 GiB, and stopped every ingest).
        ids, old, new = _host_ranks(old, new)
        hosts = len(ids)
        if hosts <= 64:
            pairs, shared = _mask_pairs(old, new, ch)
        else:
            m = np.zeros((hosts, hosts), np.int64)
            sh = np.zeros(hosts, np.int64)
            for sign, pick in ((1, ch & (nk > ok_)), (-1, ch & (nk < ok_))):
                if pick.any():  # grown with the batch; shrunk by a restart's rollback
                    small, big = (old, new) if sign > 0 else (new, old)
                    dm, dsh = _added_pairs(small, big, np.flatnonzero(pick), hosts)
                    m += sign * dm
                    sh += sign * dsh
            a, b = np.nonzero(m)
            pairs = (a, b, m[a, b])
            h = np.flatnonzero(sh)
            shared = (h, sh[h])
        pairs = (ids[pairs[0]].astype(np.int32), ids[pairs[1]].astype(np.int32), pairs[2])
        shared = (ids[shared[0]].astype(np.int32), shared[1])
        multi = int((nk[ch] > 1).sum()) - int((ok_[ch] > 1).sum())

    totals = [int((ne > 0).sum()) - int((oe > 0).sum()),
              int(ne.sum(dtype=np.int64)) - int(oe.sum(dtype=np.int64)),
              int((new.epoch_dups - old.epoch_dups).sum(dtype=np.int64)),
              int(new.dup.sum()) - int(old.dup.sum()), multi]
    return Deltas(ranks, levels, pairs, shared, totals)


def once_deltas(q: Once) -> Deltas:
    """The agg-table changes of records started once (RunState.once), from what their rows
    said: the same quantities as `deltas`, without the records' host and epoch sets."""
    first3 = q.level < 3
    first3[q.pend] = False  # their triples held real steps: ranks from both triples
    rank, step, rec = [], [], []
    for j in range(3):
        s, d = _tally(q.step[first3 & (q.level == j)])
        rank.append(np.full(len(s), j + 1, np.int8))
        step.append(s)
        rec.append(d)
    ranks = (np.concatenate(rank), np.concatenate(step), np.concatenate(rec))
    if len(q.pend):
        ranks = _cat_ranks(ranks, _rank_deltas(q.pend_old, q.pend_new))
    levels = _net(q.level + 1, q.level[q.level > 0])
    # A host added: pairs with each host the record was on, both ways, and itself (the
    # diagonal: records the host saw); the record becomes shared when it was on one host.
    add = np.flatnonzero(q.added)
    k = np.diff(q.before_ptr)[add]
    hosts = int(max(q.host.max(initial=-1), q.before.max(initial=-1))) + 1
    x = np.repeat(q.host[add], k)
    y = q.before[spans(q.before_ptr[:-1][add], k)]
    code, count = _tally(np.r_[x * hosts + y, y * hosts + x, q.host[add] * (hosts + 1)])
    one = k == 1
    first = q.before[q.before_ptr[:-1][add][one]]
    shared = _tally(np.r_[first, q.host[add][k >= 1]])
    new_dups = q.repeat & ~q.was_dup
    totals = [int((q.level == 0).sum()), len(q), int(q.repeat.sum()), int(new_dups.sum()),
              int(one.sum())]
    return Deltas(ranks, levels,
                  ((code // hosts).astype(np.int32), (code % hosts).astype(np.int32), count),
                  (shared[0].astype(np.int32), shared[1]), totals)


def _sum_by(cols: list[np.ndarray], counts: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
    """`counts` summed over equal rows of `cols`, non-zero sums only."""
    if not len(counts):
        return cols, counts
    order = np.lexsort(cols[::-1])
    cols, counts = [np.asarray(c)[order] for c in cols], np.asarray(counts)[order]
    head = np.ones(len(counts), bool)
    head[1:] = np.any([c[1:] != c[:-1] for c in cols], axis=0)
    at = np.flatnonzero(head)
    total = np.add.reduceat(counts, at)
    nz = total != 0
    return [c[at][nz] for c in cols], total[nz]


def _sum_deltas(a: Deltas, b: Deltas) -> Deltas:
    def both(x: tuple, y: tuple) -> tuple:
        cols, n = _sum_by([np.r_[p, q] for p, q in zip(x[:-1], y[:-1], strict=True)],
                          np.r_[x[-1], y[-1]].astype(np.int64))
        return (*cols, n)

    return Deltas(both(a.ranks, b.ranks), both(a.levels, b.levels), both(a.pairs, b.pairs),
                  both(a.shared, b.shared), [p + q for p, q in zip(a.totals, b.totals,
                                                                   strict=True)])


def _upsert(cur, table: str, data: dict, conflict: str, update: str) -> None:
    if not len(next(iter(data.values()))):
        return
    cur.register("agg_delta", pa.table(data))
    names = ", ".join(data)
    cur.execute(f"""INSERT INTO {table} ({names}) SELECT {names} FROM agg_delta
        ON CONFLICT ({conflict}) DO UPDATE SET {update} = {update} + excluded.{update}""")
    cur.unregister("agg_delta")


def write_deltas(cur, run: int, d: Deltas, *, seg_files: int) -> None:
    """Add the changes to the agg tables (inside the caller's transaction)."""
    def runs(k: int) -> np.ndarray:
        return np.full(k, run, np.int32)

    rank, step, rec = d.ranks
    _upsert(cur, "agg_ranks", {"run": runs(len(rank)), "rank": rank, "step": step,
                               "records": rec}, "run, rank, step", "records")
    lv, rec = d.levels
    _upsert(cur, "agg_levels", {"run": runs(len(lv)), "level": lv, "records": rec},
            "run, level", "records")
    a, b, rec = d.pairs
    _upsert(cur, "agg_host_pairs", {"run": runs(len(a)), "a": a, "b": b, "records": rec},
            "run, a, b", "records")
    h, sh = d.shared
    _upsert(cur, "agg_hosts", {"run": runs(len(h)), "host": h, "shared": sh}, "run, host",
            "shared")
    cur.execute("""
        INSERT INTO agg_runs VALUES ($1, $2, $3, $4, $5, $6, $7)
        ON CONFLICT (run) DO UPDATE SET seg_files = seg_files + excluded.seg_files,
            records = records + excluded.records, exposures = exposures + excluded.exposures,
            epoch_duplicates = epoch_duplicates + excluded.epoch_duplicates,
            epoch_duplicate_records = epoch_duplicate_records + excluded.epoch_duplicate_records,
            multi_host_records = multi_host_records + excluded.multi_host_records""",
                [run, seg_files, *d.totals])
