"""The background ingester: one thread of the service that owns the ledger, ingesting new spool
files exactly once (audit.ingest) while request handlers read with their own cursors."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from audit import spool as sp
from audit.ingest import ingest
from audit.ledger import Ledger

log = logging.getLogger("tally.api")


class IngestLoop:
    def __init__(self, ledger: Ledger, spool: Path, *, interval: float = 1.0,
                 after_round: Callable[[], None] | None = None) -> None:
        self.ledger, self.spool, self.interval = ledger, Path(spool), interval
        self.after_round = after_round
        self.rounds = 0
        self.files = 0
        self.rows = 0
        self.quarantined = 0
        self.last_error: str | None = None
        self.last_round_at: float | None = None
        self._oldest_pending: float | None = None  # mtime of the oldest file not yet ingested
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

    def lag_seconds(self) -> float:
        t = self._oldest_pending
        return 0.0 if t is None else max(0.0, time.time() - t)

    def _pending_oldest(self) -> float | None:
        cur = self.ledger.cursor()
        try:
            done = {r[0] for r in cur.execute("SELECT path FROM segments").fetchall()}
            held = {r[0] for r in cur.execute("SELECT path FROM quarantine").fetchall()}
        finally:
            cur.close()
        oldest = None
        for f in sp.scan(self.spool):
            if isinstance(f, sp.SpoolFile) and f.rel not in done and f.rel not in held:
                try:
                    m = f.path.stat().st_mtime
                except FileNotFoundError:
                    continue
                oldest = m if oldest is None else min(oldest, m)
        return oldest

    def run_once(self) -> None:
        self._oldest_pending = self._pending_oldest()
        if self._oldest_pending is not None:
            res = ingest(self.spool, self.ledger)
            self.files += res.files
            self.rows += res.rows
            self.quarantined += len(res.quarantined)
            for rel, reason in res.quarantined:
                log.warning("quarantined %s: %s", rel, reason)
        self._oldest_pending = None
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
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.exception("ingest round failed")
            self._stop.wait(self.interval)
