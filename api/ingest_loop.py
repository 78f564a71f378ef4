"""The background ingester: one thread of the service that owns the ledger, ingesting new spool
files exactly once (audit.ingest) while request handlers read with their own cursors."""

from __future__ import annotations

import logging
import os
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
        self._done: set[str] = set()
        self._seen_id = -1
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

    def _pending(self) -> list[tuple[sp.SpoolFile | sp.Stray, os.stat_result]]:
        """One scan of the spool: files neither ingested nor held in quarantine unchanged.
        The ingested paths are remembered between rounds (this process is the ledger's only
        writer); ingest() checks them again in its own snapshot."""
        cur = self.ledger.cursor()
        try:
            for fid, path in cur.execute("SELECT file_id, path FROM segments WHERE file_id > ?",
                                         [self._seen_id]).fetchall():
                self._done.add(path)
                self._seen_id = max(self._seen_id, fid)
            new = [f for f in sp.scan(self.spool) if f.rel not in self._done]
            held = dict(cur.execute("SELECT path, bytes, mtime_ns FROM quarantine "
                                    "WHERE path IN (SELECT unnest(?))",
                                    [[f.rel for f in new]]).fetchall() if new else [])
        finally:
            cur.close()
        out = []
        for f in new:
            try:
                st = f.path.stat()
            except FileNotFoundError:
                continue
            if held.get(f.rel) != (st.st_size, st.st_mtime_ns):
                out.append((f, st))
        return out

    def run_once(self) -> None:
        pending = self._pending()
        if pending:
            self._oldest_pending = min(st.st_mtime for _, st in pending)
            res = ingest(self.spool, self.ledger, listing=pending)
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
