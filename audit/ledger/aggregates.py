"""Aggregates kept at ingest, so that live queries never scan `consumption`.

Two layers:
- the `agg_*` tables of the ledger (schema in audit/ledger/database.py), written in the same
  transaction as the segment files they count, so a reader sees a file's effect entirely or not
  at all;
- per-record state (audit/ledger/state.py) in memory, rebuilt from `effective_consumption` when
  a process first ingests.

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
(audit.ledger.live).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

import duckdb
import numpy as np
import pyarrow as pa

from audit.core.exposure import start_sql
from audit.ledger.database import Ledger
from audit.ledger.snapshot import Applied, Invalid, Snapshots, lowered_cuts
from audit.ledger.state import (
    EPOCH_BITS,
    HOST_BITS,
    NO_STEP,
    STATE,
    Records,
    RunState,
    Starts,
    group,
)

log = logging.getLogger("tally.state")
CATCH_UP_ROWS = 8_000_000  # consumption rows read at a time when a snapshot catches up


@dataclass
class Deltas:
    """What changed between two states of the same records, ready for the agg tables."""

    ranks: tuple[np.ndarray, np.ndarray, np.ndarray]  # rank, step, records
    levels: tuple[np.ndarray, np.ndarray]  # level, records
    pairs: tuple[np.ndarray, np.ndarray, np.ndarray]  # a, b, records
    shared: tuple[np.ndarray, np.ndarray]  # host, records
    totals: list[int]  # records, exposures, epoch duplicates, their records, multi-host


class Aggregates:
    """The aggregates of one open ledger, for the one process that ingests into it.

    Writes happen inside the caller's transaction; `commit()` (under `lock`, right after the
    COMMIT) publishes the per-record state, `discard()` drops it after a ROLLBACK. Readers of
    the per-record state take `lock` while they open their snapshot.
    """

    def __init__(self, max_state_bytes: int | None = None) -> None:
        self.runs: dict[int, RunState] = {}
        self.lock = threading.Lock()
        self.ingesting = threading.Lock()  # held by audit.ledger.ingest for a whole call
        self._pending: list[tuple[int, Records]] = []
        self.max_state_bytes = max_state_bytes or default_max_state_bytes()
        self.snapshots: Snapshots | None = None  # set by load() for a ledger on disk

    # ---- loading ---------------------------------------------------------------------------
    @classmethod
    def load(cls, ledger: Ledger, *, use_snapshots: bool = True) -> Aggregates:
        """Per-record state from the ledger: each run's from its snapshot (audit.ledger.
        snapshot) caught up with the files ingested after it, or rebuilt from
        `effective_consumption` where there is no usable snapshot (why, logged once per run).
        Agg tables rebuilt for runs whose tables do not cover every ingested segment file (a
        ledger filled before the tables existed)."""
        agg = cls()
        agg.snapshots = Snapshots(ledger.path, ledger.ledger_id)
        cur = ledger.cursor()
        try:
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
            if rebuild:
                t0 = time.monotonic()
                every = set(rebuild) == set(counts)  # the plain scan when all runs rebuild
                for run, rec in _recompute(cur, None if every else list(rebuild)).items():
                    agg._state(run).put(rec)
                seconds = time.monotonic() - t0
                for run, why in rebuild.items():
                    if use_snapshots:
                        log.warning("run %s: per-record state rebuilt from the ledger (%s) in "
                                    "%.2f s", names[run], why, seconds)
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
        snap = self.snapshots.open(cur, run, run_id, STATE)
        st = self.runs[run] = RunState.over(snap.rows, snap.top)
        try:
            rows = self._catch_up(cur, run, snap.applied)
        except BaseException:
            del self.runs[run]
            raise
        self.snapshots.restored(run, snap.applied)
        log.info("run %s: per-record state restored from its snapshot (%s records) and %s rows "
                 "ingested after it in %.2f s", run_id, f"{st.size:,}", f"{rows:,}",
                 time.monotonic() - t0)

    def _catch_up(self, cur: duckdb.DuckDBPyConnection, run: int, since: Applied) -> int:
        """Apply to the run's state what the ledger holds beyond `since` (what a snapshot
        covers): the record starts of later segment files, as increments (`group`, `merged`),
        and records whose rows left the lineage since, recomputed. Returns the rows read."""
        st = self.runs[run]
        files = cur.execute("""SELECT file_id, n_rows FROM segments
            WHERE run = ? AND kind = 'seg' AND file_id > ? ORDER BY file_id""",
                            [run, since.max_file_id]).fetchnumpy()
        ids, sizes = np.asarray(files["file_id"], np.int64), np.asarray(files["n_rows"], np.int64)
        # File id ranges of about CATCH_UP_ROWS rows each bound the memory of a long catch-up;
        # consumption is in file id order, so each range reads few row groups.
        cuts = np.searchsorted(np.cumsum(sizes), np.arange(1, 1 + sizes.sum() // CATCH_UP_ROWS)
                               * CATCH_UP_ROWS)
        for part in np.split(ids, np.unique(np.minimum(cuts + 1, len(ids)))):
            if not len(part):
                continue
            got = cur.execute(f"""SELECT record_key, step, epoch, host FROM effective_consumption
                WHERE run = ? AND file_id BETWEEN ? AND ? AND {start_sql()}""",
                              [run, int(part[0]), int(part[-1])]).fetchnumpy()
            hosts = np.asarray(got["host"], np.int64)
            order = np.argsort(hosts, kind="stable")
            keys, steps, epochs, hosts = (np.asarray(got["record_key"], np.int64)[order],
                                          np.asarray(got["step"], np.int64)[order],
                                          np.asarray(got["epoch"], np.int64)[order],
                                          hosts[order])
            edges = np.flatnonzero(np.r_[True, hosts[1:] != hosts[:-1], True])
            inc = group([Starts(keys[a:b], steps[a:b], epochs[a:b], int(hosts[a]))
                         for a, b in zip(edges[:-1], edges[1:], strict=True)])
            st.put(st.get(inc.keys).merged(inc))
        lowered = lowered_cuts(since.lineage, self.cuts(cur, run))
        if lowered:
            keys = _rolled_back_keys(cur, run, lowered)
            if len(keys):
                new = Records.empty(keys)
                found = _recompute(cur, [run], keys).get(run)
                if found is not None:
                    new.set(np.searchsorted(new.keys, found.keys), found)
                st.put(new)
        return int(sizes.sum())

    # ---- snapshots -------------------------------------------------------------------------
    def save(self, ledger: Ledger, *, final: bool = False) -> None:
        """Write the snapshots that are due (audit.ledger.snapshot.Snapshots.due); `final` on a
        clean end of the process. Waits for the ingest under way."""
        with self.ingesting:
            self.save_locked(ledger, final=final)

    def save_locked(self, ledger: Ledger, *, final: bool = False) -> None:
        """`save` for a caller that holds `ingesting`: the state cannot change meanwhile, so
        the rows are written from where they are (no copy). Readers go on throughout: they
        never write the state, and `lock` is not taken."""
        if self.snapshots is None or getattr(ledger, "_aggregates", None) is not self:
            return  # dropped (invalidate): the ledger's next user reloads it
        cur = ledger.cursor()
        try:
            names = dict(cur.execute("SELECT run, run_id FROM runs").fetchall())
            for run, st in list(self.runs.items()):
                applied = self.snapshots.due(cur, run, final=final)
                if applied is not None:
                    rows = min(st.size, st.top + 1)
                    self.snapshots.write(run, names[run], st.data[:rows], st.top, applied)
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
            st = self._state(run)
            new = st.get(np.flatnonzero(st.exposures[: st.size] > 0))
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
        """Take out of the per-record state the rows that a new attempt just rolled back.
        Call it before the batch inserts any row: the recomputation reads `consumption`."""
        lowered = lowered_cuts(before, self.cuts(cur, run))
        if not lowered:
            return
        keys = _rolled_back_keys(cur, run, lowered)
        if not len(keys):
            return
        new = Records.empty(keys)
        found = _recompute(cur, [run], new.keys).get(run)
        if found is not None:
            new.set(np.searchsorted(new.keys, found.keys), found)
        write_deltas(cur, run, deltas(self.get(run, new.keys), new), seg_files=0)
        self._stage(run, new)

    def increments(self, run: int, parts: list[Starts]) -> tuple[Records, Deltas]:
        """The new state of the records that `parts` (starts already cut to the lineage)
        touch, and what changed: numpy only, so it can run while the batch's rows insert."""
        inc = group(parts)
        old = self.get(run, inc.keys)
        new = old.merged(inc)
        return new, deltas(old, new)

    def add(self, cur: duckdb.DuckDBPyConnection, run: int, new: Records, d: Deltas,
            seg_files: int) -> None:
        write_deltas(cur, run, d, seg_files=seg_files)
        self._stage(run, new)

    def _stage(self, run: int, new: Records) -> None:
        """Pending until commit(); the key bound rises now, before the COMMIT (readers rely
        on it to skip the lock, and a bound too high after a ROLLBACK is only cautious)."""
        self._pending.append((run, new))
        if len(new.keys):
            st = self._state(run)
            st.top = max(st.top, int(new.keys[-1]))

    def too_large(self, key: int) -> str | None:
        """Why a record key cannot go into the live state (None: it can). The state is dense
        by key, so one key sets its size; the bound keeps a file from exhausting memory."""
        need = (key + 1) * STATE.itemsize
        if need <= self.max_state_bytes:
            return None
        return (f"record_key {key:,} would need {need / 2**30:,.1f} GiB of live state, more "
                f"than the {self.max_state_bytes / 2**30:,.1f} GiB this process allows "
                f"(TALLY_MAX_STATE_GB)")

    def reserve(self) -> None:
        """Grow the state for the pending changes (before the COMMIT: what can fail, such as
        an allocation, fails while the transaction can still roll back)."""
        for run, rec in self._pending:
            if len(rec.keys):
                self._state(run).reserve(int(rec.keys[-1]) + 1)

    def commit(self) -> None:
        for run, rec in self._pending:
            self._state(run).put(rec)
        self._pending = []

    def discard(self) -> None:
        self._pending = []

    def invalidate(self, ledger: Ledger) -> None:
        """The state no longer matches the ledger: the next user reloads it from the ledger."""
        self._pending = []
        if getattr(ledger, "_aggregates", None) is self:
            ledger._aggregates = None

    def get(self, run: int, keys: np.ndarray) -> Records:
        """State as this transaction sees it: committed, then this transaction's changes."""
        out = self._state(run).get(keys)
        for r, rec in self._pending:
            if r != run or not len(rec.keys) or not len(keys):
                continue
            pos = np.minimum(np.searchsorted(rec.keys, keys), len(rec.keys) - 1)
            hit = np.flatnonzero(rec.keys[pos] == keys)
            out.set(hit, rec.take(pos[hit]))
        return out


def default_max_state_bytes() -> int:
    """Half the machine's memory, or TALLY_MAX_STATE_GB."""
    gb = os.environ.get("TALLY_MAX_STATE_GB")
    if gb:
        return int(float(gb) * 2**30)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def for_ledger(ledger: Ledger) -> Aggregates:
    """The ledger's aggregates, loaded on first use by this process."""
    agg = getattr(ledger, "_aggregates", None)
    if agg is None:
        agg = Aggregates.load(ledger)
        ledger._aggregates = agg
    return agg


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


def _recompute(cur: duckdb.DuckDBPyConnection, runs: list[int] | None = None,
               keys: np.ndarray | None = None) -> dict[int, Records]:
    """Per-record state straight from `effective_consumption`: all runs, some runs, or some
    keys of one run."""
    where, params = "", []
    if runs is not None:
        where = "AND run IN (SELECT unnest(?))"
        params = [[int(r) for r in runs]]
    if keys is not None:
        where += " AND record_key IN (SELECT k FROM recompute_keys)"
        cur.register("recompute_keys", pa.table({"k": keys}))
    res = cur.execute(f"""
        SELECT run, record_key, exposures,
               coalesce(earliest[1], {NO_STEP}) AS step1, coalesce(earliest[2], {NO_STEP}) AS step2,
               coalesce(earliest[3], {NO_STEP}) AS step3, hosts, epochs, epoch_exposures
        FROM (SELECT run, record_key, count(*) AS exposures, min(step, 3) AS earliest,
                     -- The shift counts are cast to UBIGINT: UBIGINT << INTEGER is a HUGEINT,
                     -- which reaches numpy as float64 and loses every bit below 2^(top - 52)
                     -- of a mask with hosts (epochs) 53..63 in it.
                     bit_or(CASE WHEN host < {HOST_BITS} THEN 1::UBIGINT << host::UBIGINT
                            ELSE 0::UBIGINT END) AS hosts,
                     bit_or(CASE WHEN epoch >= 0
                            THEN 1::UBIGINT << (epoch % {EPOCH_BITS})::UBIGINT
                            ELSE 0::UBIGINT END) AS epochs,
                     count(*) FILTER (WHERE epoch >= 0) AS epoch_exposures
              FROM effective_consumption WHERE {start_sql()} {where} GROUP BY ALL)
        ORDER BY run, record_key""", params).fetchnumpy()
    if keys is not None:
        cur.unregister("recompute_keys")
    out = {}
    runs = np.asarray(res["run"])
    for r in np.unique(runs):
        m = runs == r
        rec = Records(
            np.asarray(res["record_key"], np.int64)[m], np.asarray(res["exposures"], np.int32)[m],
            np.stack([np.asarray(res[c], np.int64)[m] for c in ("step1", "step2", "step3")],
                     axis=1),
            np.asarray(res["hosts"], np.uint64)[m], np.asarray(res["epochs"], np.uint64)[m],
            np.asarray(res["epoch_exposures"], np.int32)[m])
        out[int(r)] = rec
    return out


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


def deltas(old: Records, new: Records) -> Deltas:
    """The agg-table changes between two states of the same records (numpy only)."""
    rk, st, rc = [], [], []
    for j in range(3):
        os_, ns = old.steps[:, j], new.steps[:, j]
        ch = os_ != ns
        s, d = _net(ns[ch & (ns != NO_STEP)].astype(np.int64),
                    os_[ch & (os_ != NO_STEP)].astype(np.int64))
        rk.append(np.full(len(s), j + 1, np.int8))
        st.append(s)
        rc.append(d)
    ranks = (np.concatenate(rk), np.concatenate(st), np.concatenate(rc))

    oe, ne = old.exposures, new.exposures
    ch = oe != ne
    levels = _net(ne[ch & (ne > 0)].astype(np.int64), oe[ch & (oe > 0)].astype(np.int64))

    pairs = (np.zeros(0, np.int32),) * 2 + (np.zeros(0, np.int64),)
    shared = (np.zeros(0, np.int32), np.zeros(0, np.int64))
    multi = 0
    ch = old.hosts != new.hosts
    if ch.any():
        # By distinct host mask: a record counts for every pair of hosts in its mask.
        masks, d = _net(new.hosts[ch].view(np.int64), old.hosts[ch].view(np.int64))
        masks = masks.view(np.uint64)
        width = int(np.bitwise_or.reduce(masks)).bit_length() if len(masks) else 0
        bits = ((masks[:, None] >> np.arange(width, dtype=np.uint64)) & np.uint64(1)
                ).astype(np.float64)
        w = d.astype(np.float64)
        m = (bits.T @ (bits * w[:, None])).round().astype(np.int64)
        a, b = np.nonzero(m)
        pairs = (a.astype(np.int32), b.astype(np.int32), m[a, b])
        many = np.bitwise_count(masks) >= 2
        sh = (w[many] @ bits[many]).round().astype(np.int64) if width else np.zeros(0, np.int64)
        h = np.flatnonzero(sh)
        shared = (h.astype(np.int32), sh[h])
        multi = int(d[many].sum())

    do = old.epoch_exposures - np.bitwise_count(old.epochs).astype(np.int32)
    dn = new.epoch_exposures - np.bitwise_count(new.epochs).astype(np.int32)
    totals = [int((ne > 0).sum()) - int((oe > 0).sum()),
              int(ne.sum(dtype=np.int64)) - int(oe.sum(dtype=np.int64)),
              int((dn - do).sum(dtype=np.int64)), int((dn > 0).sum()) - int((do > 0).sum()),
              multi]
    return Deltas(ranks, levels, pairs, shared, totals)


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
