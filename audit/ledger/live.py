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


@dataclass
class Snap:
    """What a request reads: one snapshot transaction of the ledger."""

    cur: Any
    run: int | None
    gen: int  # the newest file id in the snapshot: its version, for cached answers
    uni: q.Universe
    outside: np.ndarray | None = None  # exposures of the keys seen outside the universe
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
                keys = st.seen(snap.uni.n)
                snap.outside = st.get(keys).exposures if len(keys) else None
        return snap

    def record_exposures(self, run_id: str) -> np.ndarray:
        """Effective exposures per record key (a copy), consistent with a snapshot."""
        def copy(run: int) -> np.ndarray:
            st = self.agg.runs.get(run)
            return np.zeros(0, np.int64) if st is None else st.exposures()

        with self.read(run_id, locked=copy) as snap:
            return snap.state

    def record_states(self, runs: tuple[int, ...]) -> Callable[[int], dict[int, np.ndarray]]:
        """A `locked` reader for `read` or `answer`: each run's exposures per record key,
        copied (an empty array for a run with no exposure yet)."""
        def copy(_: int) -> dict[int, np.ndarray]:
            out = {}
            for run in runs:
                st = self.agg.runs.get(run)
                out[run] = np.zeros(0, np.int64) if st is None else st.exposures()
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
            value = compute(snap)
        with self._answers_lock:
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
            return {"totals": q.totals(snap.cur, snap.run),
                    "coverage": q.coverage(snap.cur, snap.run, snap.uni, None, snap.outside)}
        return self.answer(("facts", run_id), run_id, compute, outside=True)

    def hosts(self, run_id: str) -> dict[str, Any]:
        return self.answer(("hosts", run_id), run_id,
                           lambda snap: q.hosts(snap.cur, snap.run))

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
