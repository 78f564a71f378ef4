"""The background ingester: one thread of the service that owns the ledger, ingesting new spool
files exactly once (tally.audit.ledger.ingest) while request handlers read with their own cursors
(tally.audit.ledger.live)."""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from tally.audit.hook import spool as sp
from tally.audit.ledger.aggregates import for_ledger
from tally.audit.ledger.database import Ledger, ledger_error
from tally.audit.ledger.ingest import ingest
from tally.audit.ledger.integrity import IngestIntegrity

log = logging.getLogger("tally.ingest")
# The integrity check of files ingested before the service had the manifest, at most about
# this long a round (then the next round's new files): unbounded, its first round over a
# 500M-row ledger checked every row before any new file, and the service ingested nothing for
# the whole of seed_scale's 4-minute serve stage (bench/RESULTS.md, seventh session).
CATCH_UP_SECONDS = 1.0


class IngestLoop:
    def __init__(self, ledger: Ledger, spool: Path, *, interval: float = 1.0,
                 after_round: Callable[[], None] | None = None,
                 max_round_seconds: float = 60.0,
                 integrity: IngestIntegrity | None = None) -> None:
        for name, value in (("interval", interval), ("max_round_seconds", max_round_seconds)):
            if not (math.isfinite(value) and value > 0):  # 0: a loop at 100% of a core
                raise ValueError(f"{name} must be a number > 0, got {value}")
        self.ledger, self.spool, self.interval = ledger, Path(spool), interval
        self.max_round_seconds = max_round_seconds
        self.integrity = integrity  # checks against the manifest, at ingest
        self._round_started: float | None = None  # monotonic start of the round under way
        self._last_round_seconds = 0.0
        self.after_round = after_round
        self.rounds = 0
        self.files = 0
        self.rows = 0
        self.quarantined = 0
        self.last_error: str | None = None
        self.last_round_at: float | None = None
        # Lag is counted from when this service first listed a file, not from its mtime: a
        # spool written long ago made every restart fire ingest_lag (and its webhook) on its
        # first rounds, the files' age read as lag. Path -> wall time of its first listing,
        # until ingested (a stop mid-round leaves some for the next round).
        self._visible: dict[str, float] = {}
        self._oldest_pending: float | None = None  # first listing of the oldest one pending
        # The backlog found at start is caught up with by the first round that ends without a
        # stop; until then ingest_lag is not an alert (tally.api.alerts) and the summary says so.
        self._caught_up = False
        # Ingested files' names, by directory: the listing leaves them out by name. Their
        # stats stay in the ledger, which a sweep reads a slice a round (`_sweep`, by file id)
        # to stat them, so that another file put at an ingested path (a run id reused after its
        # spool was removed, whose new training writes the old names) reaches ingest, which
        # quarantines it. Names and their stats kept here were 365 bytes a file (512,000
        # files, bench/listing_rate.py; the seed run writes ~3.6M).
        self._done: dict[str, set[str]] = {}
        self._done_files = 0
        self._sweep_at = time.monotonic()
        self._sweep_id = -1  # the sweep's place: the last file id it stat-ed
        self.swept = 0  # ingested files stat-ed by the sweep so far
        self._seen_id = -1
        # Listing every file every round cost ~1.5 s a round at 72,000 files: a settled host
        # directory is skipped until its mtime moves (`spool.Settling`).
        self._settling = sp.Settling()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tally-api-ingest", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def overran(self) -> float | None:
        """Seconds of the round under way, or of the last one, when beyond max_round_seconds
        (a hung file system, a backlog too large for one round); None otherwise."""
        started = self._round_started
        running = 0.0 if started is None else time.monotonic() - started
        worst = max(running, self._last_round_seconds)
        return round(worst, 3) if worst > self.max_round_seconds else None

    def lag_seconds(self) -> float:
        """Seconds since this service first listed the oldest file it has not ingested yet
        (0 when none is pending)."""
        t = self._oldest_pending
        return 0.0 if t is None else max(0.0, time.time() - t)

    @property
    def catching_up(self) -> bool:
        """Whether the files found at start (the backlog of a spool written before the service
        started) are still being ingested."""
        return not self._caught_up

    def _pending(self) -> list[tuple[sp.SpoolFile | sp.Stray, os.stat_result]]:
        """One scan of the spool: files neither ingested nor held in quarantine unchanged.
        The ingested paths are remembered between rounds (this process is the ledger's only
        writer); ingest() checks them again in its own snapshot."""
        cur = self.ledger.cursor()
        try:
            for fid, path in cur.execute("SELECT file_id, path FROM segments WHERE file_id > ?",
                                         [self._seen_id]).fetchall():
                folder, _, name = path.rpartition("/")
                names = self._done.setdefault(folder, set())
                self._done_files += name not in names
                names.add(name)
                self._seen_id = max(self._seen_id, fid)
            self._settling.begin()
            # Ingested names are left out by name, even in a full listing (which lists the
            # settled directories too): a stat and a parse of each was ~15 us, 8 s a listing
            # at 512,000 files (the seed run writes ~3.6M); the sweep stats them instead.
            new = list(sp.scan(self.spool, self._settling.skip, self._done)) + self._sweep(cur)
            # Before quarantined files are set aside: a directory holding one stays listed,
            # so that the file rewritten in place (same name, no mtime change) is seen.
            self._settling.end({f.rel.rsplit("/", 1)[0] for f, _ in new})
            held = {path: (size, mtime) for path, size, mtime in (cur.execute(
                "SELECT path, bytes, mtime_ns FROM quarantine WHERE path IN (SELECT unnest(?))",
                [[f.rel for f, _ in new]]).fetchall() if new else [])}
        finally:
            cur.close()
        return [(f, st) for f, st in new if held.get(f.rel) != (st.st_size, st.st_mtime_ns)]

    # Ingested files stat-ed a round at most by the sweep (their stats read from the ledger,
    # then a stat each: 63 ms for 10,000 on this VM), paced so that each is stat-ed about once
    # every spool.FULL_LISTING_S while there are fewer than SWEEP_FILES x rounds in that time;
    # beyond that a pass takes longer (at the seed run's ~3.6M files and a round a second,
    # ~12 minutes) and costs a round no more (~30 ms).
    SWEEP_FILES = 5_000

    def _sweep(self, cur) -> list[tuple[sp.SpoolFile | sp.Stray, os.stat_result]]:
        """The next slice of ingested files (by file id), stat-ed: those now another file than
        the one the ledger ingested from their path (size or mtime moved; ingest compares the
        footers, and keeps the new stat or quarantines the file: either way, not sent again
        for it)."""
        now = time.monotonic()
        every = sp.FULL_LISTING_S
        share = 1.0 if every <= 0 else (now - self._sweep_at) / every
        self._sweep_at = now
        budget = min(self.SWEEP_FILES, math.ceil(self._done_files * min(share, 1.0)))
        if budget <= 0:
            return []
        rows = cur.execute("SELECT file_id, path, bytes, mtime_ns FROM segments "
                           "WHERE file_id > ? ORDER BY file_id LIMIT ?",
                           [self._sweep_id, budget]).fetchall()
        self._sweep_id = rows[-1][0] if len(rows) == budget else -1  # then from the start
        self.swept += len(rows)
        out = []
        for _, rel, size, mtime in rows:
            if mtime is None:
                continue  # ingested before stats were kept: nothing to compare with
            try:  # the stat alone (~3.5 us; the listing's parse of each was ~15 us)
                st = os.stat(f"{self.spool}/{rel}")
                if (size, mtime) == (st.st_size, st.st_mtime_ns):
                    continue
            except OSError:
                pass  # gone, or a link that leads nowhere: said below
            found = sp.entry(self.spool, rel)
            if found is not None and (size, mtime) != (found[1].st_size, found[1].st_mtime_ns):
                out.append(found)  # a file no longer regular goes too: ingest says why
        return out

    def run_once(self) -> None:
        self._round_started = time.monotonic()
        try:
            self._round()
        finally:
            took = self._last_round_seconds = time.monotonic() - self._round_started
            self._round_started = None
            if took > self.max_round_seconds:
                log.warning("ingest round took %.1f s, beyond --max-round-seconds %g (/healthz "
                            "says degraded)", took, self.max_round_seconds,
                            extra={"seconds": round(took, 3),
                                   "max_round_seconds": self.max_round_seconds})

    def _round(self) -> None:
        pending = self._pending()
        if pending:
            now = time.time()
            listed = [f.rel for f, _ in pending]
            self._oldest_pending = min(self._visible.setdefault(rel, now) for rel in listed)
            res = ingest(self.spool, self.ledger, listing=pending, stop=self._stop,
                         integrity=self.integrity, catch_up_seconds=CATCH_UP_SECONDS)
            self.files += res.files
            self.rows += res.rows
            self.quarantined += len(res.quarantined)
            for rel, reason in res.quarantined:
                log.warning("quarantined %s: %s", rel, reason,
                            extra={"path": rel, "reason": reason})
            if not self._stop.is_set():  # all listed went in (or to quarantine)
                for rel in listed:
                    self._visible.pop(rel, None)
        else:  # nothing new; a state rebuilt at start still gets its snapshot (ingest writes
            for_ledger(self.ledger).save(self.ledger)  # them after each round otherwise)
            if self.integrity is not None:  # files ingested before, checked (ingest does it
                cur = self.ledger.cursor()  # after its files otherwise)
                try:
                    self.integrity.catch_up(cur, stop=self._stop, seconds=CATCH_UP_SECONDS)
                finally:
                    cur.close()
        self._oldest_pending = None
        if not self._stop.is_set():
            self._caught_up = True
        self.rounds += 1
        self.last_round_at = time.time()
        if self.after_round is not None:
            self.after_round()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.run_once()
                self.last_error = None
            except Exception as exc:  # shown by /healthz; the loop goes on with the next round
                said = ledger_error(self.ledger.path, exc)
                error = f"{type(exc).__name__}: {exc}" if said is None else str(said)
                if error != self.last_error:  # not again each round while it lasts
                    if said is None:
                        log.exception("ingest round failed")
                    else:  # a full disk or a damaged ledger: the line says it all
                        log.error("ingest round failed: %s", said)
                self.last_error = error
            self._stop.wait(self.interval)
