"""The live ledger: consistent snapshots and cached answers for a process that ingests while it
answers (`tally serve`).

One process owns the ledger. Its ingester commits batches of files (audit.ledger.ingest) while
request threads read, each with its own cursor and each request inside one snapshot
transaction, so an answer never includes half a file. Answers are cached per ledger version
(the newest file id in the snapshot): between two ingested batches a repeated request costs one
small query, and after each ingest round the answers asked for lately are recomputed (`warm`).

The per-record state in memory (audit.ledger.state) must match the snapshot it is read with:
the ingester holds `Aggregates.lock` across its COMMIT and the state update, so a reader of that
state pins its snapshot under the same lock (`read(..., locked=...)`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from audit.core.errors import TallyError
from audit.ledger import lookup
from audit.ledger import queries as q
from audit.ledger.aggregates import Aggregates, for_ledger
from audit.ledger.database import Ledger, one
from audit.ledger.state import HOST_BITS, Records


@dataclass
class Snap:
    """What a request reads: one snapshot transaction of the ledger."""

    cur: Any
    run: int | None
    gen: int  # the newest file id in the snapshot: its version, for cached answers
    uni: q.Universe
    outside: Records | None = None  # state of the keys outside the universe, when asked
    state: Any = None  # what `read(locked=...)` read from the per-record state


class LiveLedger:
    """Snapshots and cached answers over an open, writable ledger."""

    ANSWERS = 512  # cached answers kept (all runs and parameters together)
    HOT, HOT_S = 32, 60.0  # answers recomputed after each ingest round: asked for lately

    def __init__(self, ledger: Ledger, uni: q.Universe) -> None:
        self.ledger = ledger
        for_ledger(ledger)  # load the per-record state now, before the first request
        self.lookup = lookup.for_ledger(ledger)  # the record lookup index (audit.ledger.lookup)
        self.uni = uni
        self._local = threading.local()
        self._cursor_lock = threading.Lock()
        self._answers: OrderedDict[tuple, Any] = OrderedDict()
        self._answers_lock = threading.Lock()
        self._hot: OrderedDict[tuple, tuple] = OrderedDict()
        self._warm_gen = -1
        self._host_sets: OrderedDict[tuple, q.HostSets] = OrderedDict()
        self._host_sets_lock = threading.Lock()
        # Per run: the newest host sets computed, when that ended and how long it took (what
        # the ingester's own answers may reuse for a while: `in_background`).
        self._host_sets_last: dict[int, tuple[q.HostSets, float, float]] = {}
        self._work = threading.local()  # .background, .stale: see in_background

    @property
    def agg(self) -> Aggregates:
        """The ledger's aggregates (reloaded from the ledger if the ingester dropped them)."""
        return for_ledger(self.ledger)

    def _cursor(self):
        cur = getattr(self._local, "cur", None)
        if cur is None:
            with self._cursor_lock:
                cur = self._local.cur = self.ledger.cursor()
        return cur

    def universe(self, cur, run: int | None) -> q.Universe:
        """The manifest's train split or --records; else what the run's writers said."""
        if self.uni.n is not None or run is None:
            return self.uni
        row = one(cur, """SELECT records_per_epoch FROM attempts WHERE run = ?
                          AND records_per_epoch IS NOT NULL ORDER BY attempt DESC LIMIT 1""",
                  [run])
        return self.uni if row is None else q.Universe(int(row[0]), "writer metadata")

    def _pin(self, cur, run_id: str | None) -> Snap:
        gen = one(cur, "SELECT coalesce(max(file_id), 0) FROM segments")[0]  # pins the snapshot
        run = None if run_id is None else q.run_of(cur, run_id)
        return Snap(cur, run, gen, self.universe(cur, run))

    @contextlib.contextmanager
    def read(self, run_id: str | None = None, *, outside: bool = False,
             locked: Callable[[int], Any] | None = None) -> Iterator[Snap]:
        """One snapshot transaction. With `outside`, also the per-record state of the keys
        outside the universe; `locked(run)` reads something else from the per-record state
        (its result in `snap.state`), pinned under the aggregates' lock. A run whose keys all
        fall inside the universe (the normal case) has no outside state to read, which the
        state's key bound says without the lock."""
        cur = self._cursor()
        cur.execute("BEGIN TRANSACTION")
        try:
            snap = self._pin(cur, run_id)
            if locked is not None or (outside and self._has_outside(snap)):
                snap = self._pin_locked(snap, run_id, locked)
            yield snap
        finally:
            cur.execute("ROLLBACK")

    def _has_outside(self, snap: Snap) -> bool:
        # `top` only grows and is raised before the COMMIT that adds keys: below the universe
        # now means below it in any snapshot taken before now.
        st = self.agg.runs.get(snap.run)
        return st is not None and snap.uni.n is not None and st.top >= snap.uni.n

    def _pin_locked(self, snap: Snap, run_id: str | None,
                    locked: Callable[[int], Any] | None) -> Snap:
        snap.cur.execute("ROLLBACK")
        snap.cur.execute("BEGIN TRANSACTION")
        with self.agg.lock:
            snap = self._pin(snap.cur, run_id)
            st = self.agg.runs.get(snap.run)
            if locked is not None:
                snap.state = locked(snap.run)
            elif st is not None and snap.uni.n is not None:
                snap.outside = st.beyond(snap.uni.n)
        return snap

    def record_exposures(self, run_id: str) -> np.ndarray:
        """Effective exposures per record key (a copy), consistent with a snapshot."""
        def copy(run: int) -> np.ndarray:
            st = self.agg.runs.get(run)
            return np.zeros(0, np.int64) if st is None else st.exposures[: st.size].copy()

        with self.read(run_id, locked=copy) as snap:
            return snap.state

    def record_states(self, runs: tuple[int, ...]) -> Callable[[int], dict[int, Any]]:
        """A `locked` reader for `read` or `answer`: each run's per-record exposures and three
        earliest exposure steps, copied (empty arrays for a run with no exposure yet)."""
        def copy(_: int) -> dict[int, tuple[np.ndarray, np.ndarray]]:
            out = {}
            for run in runs:
                st = self.agg.runs.get(run)
                out[run] = ((np.zeros(0, np.int32), np.zeros((0, 3), np.int64)) if st is None
                            else (st.exposures[: st.size].copy(),
                                  st.data["steps"][: st.size].copy()))
            return out
        return copy

    def answer(self, key: tuple, run_id: str | None, compute: Callable[[Snap], Any], *,
               outside: bool = False, locked: Callable[[int], Any] | None = None) -> Any:
        """compute(snap), or what it gave for the same ledger version. With `locked`, the
        snapshot is pinned under the aggregates' lock and `snap.state` holds what
        `locked(run)` read from the per-record state (as `read` does); only on a miss."""
        with self.read(run_id) as snap:
            hit = self._cached((snap.gen, *key))
            if hit is not None:
                return hit
            if locked is not None or (outside and self._has_outside(snap)):
                snap = self._pin_locked(snap, run_id, locked)
            outer, self._work.stale = getattr(self._work, "stale", False), False
            value = compute(snap)
            stale, self._work.stale = self._work.stale, outer or self._work.stale
        with self._answers_lock:
            if not stale:  # an answer built on older host sets is not this version's
                self._answers[(snap.gen, *key)] = value
            while len(self._answers) > self.ANSWERS:
                self._answers.popitem(last=False)
            self._hot[key] = (run_id, compute, outside, locked, time.monotonic())
            self._hot.move_to_end(key)
            while len(self._hot) > self.HOT:
                self._hot.popitem(last=False)
        return value

    def warm(self) -> None:
        """Compute the answers asked for lately for the ledger's new version, so that the
        requests after an ingest find them (run by the ingester after each round)."""
        with self.read() as snap:
            if snap.gen == self._warm_gen:
                return
            self._warm_gen = snap.gen
        with self._answers_lock:
            hot = [(k, v) for k, v in self._hot.items() if time.monotonic() - v[4] < self.HOT_S]
        for key, (run_id, compute, outside, locked, _) in hot:
            try:
                self.answer(key, run_id, compute, outside=outside, locked=locked)
            except TallyError:  # e.g. a host that no longer exists after a restart
                continue

    def _cached(self, key: tuple) -> Any:
        with self._answers_lock:
            hit = self._answers.get(key)
            if hit is not None:
                self._answers.move_to_end(key)
            return hit

    # ---- answers several endpoints share ---------------------------------------------------
    def facts(self, run_id: str) -> dict[str, Any]:
        """A run's totals and coverage (what the summary and alerts need)."""
        def compute(snap: Snap) -> dict[str, Any]:
            totals = q.totals(snap.cur, snap.run)
            sets = self.host_sets(snap)
            if sets is not None:  # beyond the hosts the agg tables track
                totals["multi_host_records"] = sets.multi_host_records
            return {"totals": totals,
                    "coverage": q.coverage(snap.cur, snap.run, snap.uni, None, snap.outside)}
        return self.answer(("facts", run_id), run_id, compute, outside=True)

    def hosts(self, run_id: str) -> dict[str, Any]:
        return self.answer(("hosts", run_id), run_id,
                           lambda snap: q.hosts(snap.cur, snap.run, self.host_sets(snap)))

    HOST_SETS = 8  # runs' host sets kept
    # The ingester's own answers (alerts, warming) may reuse a run's newest host sets until this
    # many times the pass that made them has gone by: a pass over a large run on many hosts
    # takes seconds to minutes (bench/host_sets.py: 7.1 s at 16M rows, 128 hosts), and one per
    # ingest round would stall ingest; this bounds it to ~1/HOST_SETS_SPACING of the time.
    HOST_SETS_SPACING = 10.0

    @contextlib.contextmanager
    def in_background(self) -> Iterator[None]:
        """Answers computed inside (by the ingester after a round, not for a request) may use a
        run's newest host sets of an older version, if they are recent (HOST_SETS_SPACING);
        such answers are returned but never cached, so a request always gets this version's."""
        self._work.background = True
        try:
            yield
        finally:
            self._work.background = False

    def host_sets(self, snap: Snap) -> q.HostSets | None:
        """For a run on more hosts than the per-record state tracks (HOST_BITS): its hosts'
        record sets as of the snapshot (`queries.host_sets`, one pass over the run's rows),
        computed once per version of that run's data and shared by /hosts, the summary and
        /metrics; one computation at a time. None for the other runs (the agg tables answer)."""
        h = q.host_count(snap.cur, snap.run)
        if h <= HOST_BITS:
            return None
        version = q.run_data_version(snap.cur, snap.run)
        key = (snap.run, h, version[0], version[1], tuple(version[2] or ()))
        with self._host_sets_lock:
            hit = self._host_sets.get(key)
            if hit is None:
                last = self._host_sets_last.get(snap.run)
                if (last is not None and getattr(self._work, "background", False)
                        and time.monotonic() - last[1] < self.HOST_SETS_SPACING * last[2]):
                    self._work.stale = True
                    return last[0]
                t0 = time.monotonic()
                hit = self._host_sets[key] = q.host_sets(snap.cur, snap.run, h)
                end = time.monotonic()
                self._host_sets_last[snap.run] = (hit, end, end - t0)
                while len(self._host_sets) > self.HOST_SETS:
                    self._host_sets.popitem(last=False)
            self._host_sets.move_to_end(key)
            return hit

    def host_rows(self, run_id: str) -> dict[int, int]:
        return self.answer(("host_rows", run_id), run_id, lambda snap: dict(snap.cur.execute(
            "SELECT host, sum(n_rows) FROM segments WHERE run = ? AND kind = 'seg' "
            "GROUP BY host", [snap.run]).fetchall()))

    def run_ids(self) -> list[str]:
        return self.answer(("run_ids",), None, lambda snap: [r[0] for r in snap.cur.execute(
            "SELECT run_id FROM runs ORDER BY run_id").fetchall()])

    def quarantined(self, run_id: str) -> dict[str, Any]:
        """The run's quarantined spool files: how many, and the first few with their reason."""
        with self.read() as snap:
            rows = snap.cur.execute(
                "SELECT path, reason FROM quarantine WHERE starts_with(path, ?) ORDER BY path",
                [f"{run_id}/"]).fetchall()
        return {"count": len(rows),
                "first": [{"path": p, "reason": r} for p, r in rows[:5]]}

    def quarantine_counts(self) -> dict[str, int]:
        """Quarantined files per run id (the first part of their path in the spool)."""
        with self.read() as snap:
            return dict(snap.cur.execute(
                "SELECT split_part(path, '/', 1), count(*) FROM quarantine GROUP BY ALL "
                "ORDER BY 1").fetchall())

    def files_in_ledger(self) -> int:
        with self.read() as snap:
            return one(snap.cur, "SELECT count(*) FROM segments")[0]
