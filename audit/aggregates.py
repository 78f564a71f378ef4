"""Aggregates kept at ingest, so that live queries never scan `consumption`.

Two layers:
- the `agg_*` tables of the ledger (schema in audit/ledger.py), written in the same transaction
  as the segment files they count, so a reader sees a file's effect entirely or not at all;
- per-record state (exposures, the three earliest exposure steps, the set of hosts, the set of
  epochs) in memory, one 40-byte row per record key, rebuilt from `effective_consumption` when a
  process first ingests. Keeping it as a DuckDB table was measured at ~0.1 s per 100k-row file
  for the join alone (10M records) and 1.6 s with an indexed upsert; one packed numpy row per
  record costs one cache miss to read and one to write.

From the per-record state, each batch of files changes only what it touches: the step at which
a record was first, second and third seen (`agg_ranks`: coverage and the 0/1/2/3+ histogram as
of any step), how many records sit at each exposure level (`agg_levels`: excess over ideal), the
host x host overlap (`agg_host_pairs`, `agg_hosts`) and run totals (`agg_runs`). Per-step and
per-host counts (`agg_steps`) keep every row with its attempt; readers leave out rolled-back
steps.

Restart lineage: an attempt's rows at or after its `rolled_back_from_step` stay out of the
per-record state. When a new attempt lowers a cut, the records with rows that just left the
lineage are recomputed from `effective_consumption` and the differences written.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import duckdb
import numpy as np
import pyarrow as pa

from audit.ledger import Ledger

HOST_BITS = 64  # host sets are uint64 masks: overlap is tracked for hosts 0..63
EPOCH_BITS = 64  # epoch sets are masks of epoch % 64: exact for runs of fewer than 64 epochs
NO_STEP = np.iinfo(np.int32).max

# One record's state. Fields are aligned so that column views are plain strided arrays; the
# whole row moves as one 40-byte item (np.take / np.put on a void view), which is what keeps
# the random-key gathers and scatters of a batch cheap.
STATE = np.dtype([("e", "<i4"),  # exposures (effective record starts)
                  ("ee", "<i4"),  # exposures whose epoch is known
                  ("s", "<i4", (3,)),  # the three earliest exposure steps, NO_STEP when fewer
                  ("pad", "<i4"),
                  ("h", "<u8"),  # mask of hosts < HOST_BITS
                  ("p", "<u8")])  # mask of epoch % EPOCH_BITS, known epochs only
_VOID = np.dtype((np.void, STATE.itemsize))

# Codes used while sorting a batch's starts: host code 64 = not tracked, epoch code 0 = unknown.
_HOST_BIT = np.array([1 << i for i in range(HOST_BITS)] + [0] * 64, np.uint64)
_EPOCH_BIT = np.array([0] + [1 << i for i in range(EPOCH_BITS)] + [0] * 63, np.uint64)


@dataclass
class Records:
    """Per-record state for a sorted set of record keys, one array per field (the arithmetic
    of a batch runs over contiguous columns; RunState stores rows)."""

    keys: np.ndarray  # int64, sorted, unique
    exposures: np.ndarray  # int32
    steps: np.ndarray  # int32 [n, 3]: the three earliest exposure steps, NO_STEP when fewer
    hosts: np.ndarray  # uint64 mask of hosts < HOST_BITS
    epochs: np.ndarray  # uint64 mask of epoch % EPOCH_BITS, known epochs only
    epoch_exposures: np.ndarray  # int32: exposures whose epoch is known

    @classmethod
    def empty(cls, keys: np.ndarray) -> Records:
        n = len(keys)
        return cls(np.asarray(keys, np.int64), np.zeros(n, np.int32),
                   np.full((n, 3), NO_STEP, np.int32), np.zeros(n, np.uint64),
                   np.zeros(n, np.uint64), np.zeros(n, np.int32))

    @classmethod
    def from_rows(cls, keys: np.ndarray, rows: np.ndarray) -> Records:
        r = cls(keys, rows["e"].copy(), rows["s"].copy(), rows["h"].copy(), rows["p"].copy(),
                rows["ee"].copy())
        r.steps[r.exposures == 0] = NO_STEP  # zeroed memory: never seen
        return r

    def rows(self) -> np.ndarray:
        rows = np.empty(len(self.keys), STATE)
        rows["e"], rows["ee"], rows["s"] = self.exposures, self.epoch_exposures, self.steps
        rows["pad"], rows["h"], rows["p"] = 0, self.hosts, self.epochs
        return rows

    def take(self, idx: np.ndarray) -> Records:
        return Records(self.keys[idx], self.exposures[idx], self.steps[idx], self.hosts[idx],
                       self.epochs[idx], self.epoch_exposures[idx])

    def set(self, pos: np.ndarray, other: Records) -> None:
        """Rows at `pos` take `other`'s values."""
        for f in ("exposures", "steps", "hosts", "epochs", "epoch_exposures"):
            getattr(self, f)[pos] = getattr(other, f)

    def merged(self, inc: Records) -> Records:
        """This state plus `inc`'s exposures of the same keys."""
        a, b = self.steps, inc.steps
        # The three smallest of two sorted triples: r_k = min over i + j = k of max(a_i, b_j).
        # It leaves a row alone when no incoming step enters its three, so it runs on all rows
        # when most change, and on those that can change otherwise.
        todo = np.flatnonzero(b[:, 0] < a[:, 2])
        if len(todo) > len(a) // 4:
            steps = _three_smallest(a, b)
        else:
            steps = a.copy()
            if len(todo):
                steps[todo] = _three_smallest(a[todo], b[todo])
        return Records(self.keys, self.exposures + inc.exposures, steps,
                       self.hosts | inc.hosts, self.epochs | inc.epochs,
                       self.epoch_exposures + inc.epoch_exposures)


def _three_smallest(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    (a1, a2, a3), (b1, b2, b3) = a.T, b.T
    out = np.empty_like(a)
    np.minimum(a1, b1, out=out[:, 0])
    np.minimum(np.minimum(a2, b2), np.maximum(a1, b1), out=out[:, 1])
    np.minimum(np.minimum(a3, b3), np.minimum(np.maximum(a1, b2), np.maximum(a2, b1)),
               out=out[:, 2])
    return out


@dataclass
class Starts:
    """A file's record starts (offset 0), prepared off the ingest transaction, in the
    read-ahead thread."""

    keys: np.ndarray  # int64
    steps: np.ndarray  # int64
    epochs: np.ndarray  # int32
    host: int  # a spool file holds one host's rows (checked at read)

    @classmethod
    def from_table(cls, table: pa.Table, host: int) -> Starts:
        start = table["offset"].to_numpy() == 0
        return cls(table["record_key"].to_numpy()[start], table["step"].to_numpy()[start],
                   table["epoch"].to_numpy()[start], host)

    def before(self, cut: int | None) -> Starts:
        if cut is None:
            return self
        keep = self.steps < cut
        return Starts(self.keys[keep], self.steps[keep], self.epochs[keep], self.host)


def group(parts: list[Starts]) -> Records:
    """The starts of several files as per-record increments."""
    parts = [p for p in parts if len(p.keys)]
    if not parts:
        return Records.empty(np.zeros(0, np.int64))
    keys = np.concatenate([p.keys for p in parts]).astype(np.int64, copy=False)
    steps = np.concatenate([p.steps for p in parts]).astype(np.int64, copy=False)
    epochs = np.concatenate([p.epochs for p in parts]).astype(np.int64, copy=False)
    hcode = np.repeat(np.array([min(p.host, HOST_BITS) if p.host >= 0 else HOST_BITS
                                for p in parts], np.int64), [len(p.keys) for p in parts])
    ecode = np.where(epochs >= 0, 1 + (epochs & (EPOCH_BITS - 1)), 0)
    base = int(steps.min())
    sbits = (int(steps.max()) - base).bit_length()
    shift = sbits + 14
    if int(keys.max()).bit_length() + shift <= 63:
        # One int64 per start, (key, step, host, epoch) in that order of significance: a plain
        # sort of it (SIMD, no argsort) groups by key with steps ascending.
        code = keys << shift | (steps - base) << 14 | hcode << 7 | ecode
        code.sort()
        keys, steps = code >> shift, (code >> 14 & ((1 << sbits) - 1)) + base
        hcode, ecode = code >> 7 & 127, code & 127
    else:  # keys or a step range too wide to pack
        order = np.lexsort((steps, keys))
        keys, steps, hcode, ecode = keys[order], steps[order], hcode[order], ecode[order]
    n = len(keys)
    first = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
    out = Records.empty(keys[first])
    hb, eb = _HOST_BIT[hcode], _EPOCH_BIT[ecode]
    if len(first) == n:  # every key once
        out.exposures[:] = 1
        out.steps[:, 0] = steps
        out.hosts, out.epochs, out.epoch_exposures = hb, eb, (ecode > 0).astype(np.int32)
        return out
    counts = np.diff(np.r_[first, n])
    out.exposures[:] = counts
    for j in range(3):
        ok = np.flatnonzero(counts > j) if j else slice(None)
        out.steps[ok, j] = steps[first[ok] + j]
    out.hosts, out.epochs = hb[first], eb[first]
    out.epoch_exposures = (ecode[first] > 0).astype(np.int32)
    multi = np.flatnonzero(counts > 1)
    if len(multi):  # reductions over the starts of keys seen more than once only
        sel = np.repeat(counts > 1, counts)
        at = np.r_[0, np.cumsum(counts[multi])[:-1]]
        out.hosts[multi] = np.bitwise_or.reduceat(hb[sel], at)
        out.epochs[multi] = np.bitwise_or.reduceat(eb[sel], at)
        out.epoch_exposures[multi] = np.add.reduceat((ecode[sel] > 0).astype(np.int32), at)
    return out


class RunState:
    """Per-record state of one run, indexed by record key (keys are manifest rows, so dense).
    Rows never written are zero: a row with no exposure reads as "no steps"."""

    def __init__(self) -> None:
        self.size = 0
        self.data = np.zeros(0, STATE)
        self.top = -1  # an upper bound of the keys ever put (it never goes down)

    def _grow(self, need: int) -> None:
        if need <= self.size:
            return
        cap = max(need, self.size + self.size // 8, 1024)  # geometric, without doubling memory
        if not self.size:
            self.data = np.zeros(cap, STATE)
        else:
            # realloc (mremap for large arrays): the rows already there are neither copied nor
            # faulted in again; the tail is zeroed. No view of `data` outlives a reader's hold
            # of Aggregates.lock, which puts run under.
            self.data.resize(cap, refcheck=False)
        self.size = cap

    @property
    def exposures(self) -> np.ndarray:
        return self.data["e"]

    def get(self, keys: np.ndarray) -> Records:
        keys = np.asarray(keys, np.int64)
        inside = keys < self.size
        if inside.all():
            return Records.from_rows(keys, np.take(self.data.view(_VOID), keys).view(STATE))
        rows = np.zeros(len(keys), STATE)
        rows[inside] = np.take(self.data.view(_VOID), keys[inside]).view(STATE)
        return Records.from_rows(keys, rows)

    def beyond(self, n: int) -> Records | None:
        """State of the records seen with key >= n (outside a universe of n records)."""
        if self.top < n:
            return None
        keys = n + np.flatnonzero(self.data["e"][n: self.size] > 0)
        return self.get(keys) if len(keys) else None

    def put(self, r: Records) -> None:
        if not len(r.keys):
            return
        top = int(r.keys[-1])
        self._grow(top + 1)
        np.put(self.data.view(_VOID), r.keys, r.rows().view(_VOID))
        self.top = max(self.top, top)


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

    def __init__(self) -> None:
        self.runs: dict[int, RunState] = {}
        self.lock = threading.Lock()
        self.ingesting = threading.Lock()  # held by audit.ingest for a whole call
        self._pending: list[tuple[int, Records]] = []

    # ---- loading ---------------------------------------------------------------------------
    @classmethod
    def load(cls, ledger: Ledger) -> Aggregates:
        """Per-record state from the ledger; agg tables rebuilt for runs whose tables do not
        cover every ingested segment file (a ledger filled before the tables existed)."""
        agg = cls()
        cur = ledger.cursor()
        try:
            for run, rec in _recompute(cur).items():
                agg._state(run).put(rec)
            counts = dict(cur.execute("""
                SELECT run, count(*) FROM segments WHERE kind = 'seg' GROUP BY ALL""").fetchall())
            applied = dict(cur.execute("SELECT run, seg_files FROM agg_runs").fetchall())
            for run, n in counts.items():
                if applied.get(run) != n:
                    agg._rebuild_tables(cur, run, n)
        finally:
            cur.close()
        return agg

    def _state(self, run: int) -> RunState:
        return self.runs.setdefault(run, RunState())

    def _rebuild_tables(self, cur: duckdb.DuckDBPyConnection, run: int, files: int) -> None:
        cur.execute("BEGIN TRANSACTION")
        try:
            for t in ("agg_steps", "agg_ranks", "agg_levels", "agg_host_pairs", "agg_hosts",
                      "agg_runs"):
                cur.execute(f"DELETE FROM {t} WHERE run = ?", [run])
            cur.execute("""
                INSERT INTO agg_steps SELECT run, attempt, host, step, count(*), sum(n_tokens),
                    count(*) FILTER (WHERE "offset" = 0), file_id
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
        lowered = []
        for attempt, cut in self.cuts(cur, run).items():
            old = before.get(attempt)
            if attempt in before and cut is not None and (old is None or cut < old):
                lowered.append((attempt, cut, old))
        if not lowered:
            return
        clauses = " OR ".join("(attempt = ? AND step >= ?" + (" AND step < ?)" if old is not None
                                                              else ")")
                              for _, _, old in lowered)
        params = [run] + [x for a, cut, old in lowered
                          for x in ((a, cut) if old is None else (a, cut, old))]
        keys = cur.execute(f"""SELECT DISTINCT record_key FROM consumption
            WHERE run = ? AND "offset" = 0 AND ({clauses})""", params).fetchnumpy()["record_key"]
        if not len(keys):
            return
        new = Records.empty(np.sort(np.asarray(keys, np.int64)))
        found = _recompute(cur, run, new.keys).get(run)
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

    def commit(self) -> None:
        for run, rec in self._pending:
            self._state(run).put(rec)
        self._pending = []

    def discard(self) -> None:
        self._pending = []

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


def for_ledger(ledger: Ledger) -> Aggregates:
    """The ledger's aggregates, loaded on first use by this process."""
    agg = getattr(ledger, "_aggregates", None)
    if agg is None:
        agg = Aggregates.load(ledger)
        ledger._aggregates = agg
    return agg


def _recompute(cur: duckdb.DuckDBPyConnection, run: int | None = None,
               keys: np.ndarray | None = None) -> dict[int, Records]:
    """Per-record state straight from `effective_consumption` (all runs, or some keys of one)."""
    where, params = "", []
    if run is not None:
        where = "AND run = ? AND record_key IN (SELECT k FROM recompute_keys)"
        params = [run]
        cur.register("recompute_keys", pa.table({"k": keys}))
    res = cur.execute(f"""
        SELECT run, record_key, n,
               coalesce(s[1], {NO_STEP}) AS s1, coalesce(s[2], {NO_STEP}) AS s2,
               coalesce(s[3], {NO_STEP}) AS s3, hosts, epochs, ee
        FROM (SELECT run, record_key, count(*) AS n, min(step, 3) AS s,
                     bit_or(CASE WHEN host < {HOST_BITS} THEN 1::UBIGINT << host
                            ELSE 0::UBIGINT END) AS hosts,
                     bit_or(CASE WHEN epoch >= 0 THEN 1::UBIGINT << (epoch % {EPOCH_BITS})
                            ELSE 0::UBIGINT END) AS epochs,
                     count(*) FILTER (WHERE epoch >= 0) AS ee
              FROM effective_consumption WHERE "offset" = 0 {where} GROUP BY ALL)
        ORDER BY run, record_key""", params).fetchnumpy()
    if run is not None:
        cur.unregister("recompute_keys")
    out = {}
    runs = np.asarray(res["run"])
    for r in np.unique(runs):
        m = runs == r
        rec = Records(
            np.asarray(res["record_key"], np.int64)[m], np.asarray(res["n"], np.int32)[m],
            np.stack([np.asarray(res[c], np.int32)[m] for c in ("s1", "s2", "s3")], axis=1),
            np.asarray(res["hosts"], np.uint64)[m], np.asarray(res["epochs"], np.uint64)[m],
            np.asarray(res["ee"], np.int32)[m])
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
