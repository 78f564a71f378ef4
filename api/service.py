"""What the live API's routes share: the service (the live ledger with its snapshots and cached
answers, the ingest loop, live findings, the webhook, and the settings it was started with),
its lifespan (what starts with the app and stops with it), and the JSON answers, encoded once.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse, Response

from tally.api.alerts import Webhook, evaluate, status
from tally.api.findings import LiveFindings
from tally.api.settings import ServeSettings
from tally.audit.core.errors import NotFound, Unavailable
from tally.audit.ledger import queries as q
from tally.audit.ledger.database import Ledger
from tally.audit.ledger.ingest_loop import IngestLoop
from tally.audit.ledger.integrity import IngestIntegrity
from tally.audit.ledger.integrity import totals as integrity_totals
from tally.audit.ledger.live import LiveLedger, Snap
from tally.pipeline.manifest_file import ManifestKeyIndex

SWITCH_INTERVAL = 0.0005  # seconds; see Service.lifespan


class Service:
    """What the routes share: the live ledger (snapshots and cached answers), the ingest loop,
    and the settings the service was started with."""

    def __init__(self, ledger: Ledger, settings: ServeSettings) -> None:
        manifest, spool = settings.domains, settings.spool
        if manifest is not None:
            uni = q.Universe(manifest.train_records, "manifest")
        elif settings.records is not None:
            uni = q.Universe(settings.records, "records option")
        else:
            uni = q.Universe(None, "unknown")
        self.ledger, self.settings = ledger, settings
        self.live = LiveLedger(ledger, uni)
        self.live.revalidate = spool is not None  # the ingest loop refreshes the answers
        self.manifest = manifest  # its domains (tally.pipeline.manifest_file.ManifestDomains)
        self.webhook = Webhook(settings.webhook)
        # Integrity at ingest: each file's rows against the manifest's hash and length by key,
        # a cache beside the ledger (tally.audit.ledger.integrity).
        self.integrity = None
        if spool is not None and settings.manifest is not None:
            path, cache = settings.manifest, Path(f"{ledger.path}.integrity")
            self.integrity = IngestIntegrity(lambda: ManifestKeyIndex(path, cache))
        self.loop = (IngestLoop(ledger, spool, interval=settings.interval,
                                after_round=self.after_round,
                                max_round_seconds=settings.max_round_seconds,
                                integrity=self.integrity)
                     if spool is not None else None)
        # Live findings: a live reconcile of each run over the spool (tally.api.findings).
        self.findings = None
        if settings.findings_every and spool is not None and manifest is not None:
            self.findings = LiveFindings(spool, manifest.path,
                                         Path(f"{ledger.path}.findings"),
                                         settings.findings_every, self._versions)

    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        """The app's lifespan: the ingest loop and live findings run while it serves; at the
        end the per-record state's snapshot is saved."""
        # A request hands the GIL back and forth a few dozen times (event loop, worker thread,
        # each DuckDB call); with the default 5 ms switch interval each hand-back can wait that
        # long behind the ingester's Python work, which made the p99 latency 5-10x the p50.
        switch = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_INTERVAL)
        if self.loop is not None:
            self.loop.start()
        if self.findings is not None:
            self.findings.start()
        try:
            yield
        finally:
            if self.findings is not None:
                self.findings.stop()
            if self.loop is not None:
                self.loop.stop()
            self.live.close()
            # A clean stop leaves the per-record state's snapshot current enough for a restart
            # in seconds (tally.audit.ledger.snapshot); a kill leaves the last one, which catches
            # up.
            # A state dropped meanwhile (invalidated) is not reloaded only to be saved.
            agg = self.ledger._aggregates
            if agg is not None:
                agg.save(self.ledger, final=True)
            self.webhook.close()
            sys.setswitchinterval(switch)

    def _versions(self) -> dict[str, int]:
        with self.live.read() as snap:
            return q.run_versions(snap.cur)

    def json(self, key: tuple, run_id: str | None, compute: Callable[[Snap], Any], *,
             outside: bool = False) -> Response:
        """A cached answer as a JSON response (encoded once per ledger version)."""
        body = self.live.answer(key, run_id, lambda snap: encode(compute(snap)),
                                outside=outside)
        return Response(body, media_type="application/json")

    def summary(self, run_id: str, *, fresh: bool = False) -> dict[str, Any]:
        f = self.live.facts(run_id, fresh=fresh)
        t, cov = f["totals"], f["coverage"]
        n = cov["train_records"]
        first_pass = n is None or cov["exposures"] <= n
        lag = self.loop.lag_seconds() if self.loop is not None else 0.0
        catching_up = self.loop is not None and self.loop.catching_up
        live = None if self.findings is None else self.findings.summary(run_id)
        at_ingest = self.integrity_at_ingest(run_id, fresh=fresh)
        alerts = evaluate(self.settings.thresholds, epoch_duplicates=t["epoch_duplicates"],
                          multi_host_records=t["multi_host_records"], first_pass=first_pass,
                          lag_seconds=lag, behind=cov.get("behind_ideal"),
                          non_finite_losses=t["non_finite_losses"]["count"], findings=live,
                          catching_up=catching_up, at_ingest=at_ingest)
        return {"run_id": run_id, "status": status(alerts), "alerts": alerts,
                "last_step": cov["latest_step"], **t,
                "state": "finished" if t["finished"] else "running", "coverage": cov,
                "ingest_lag_seconds": lag, "ingest_state": None if self.loop is None else
                "catching up" if catching_up else "live",
                "quarantined_files": self.live.quarantined(run_id),
                "findings": live, "integrity_at_ingest": at_ingest}

    def integrity_at_ingest(self, run_id: str, *, fresh: bool = False) -> dict[str, Any] | None:
        """The run's integrity as checked at ingest against the manifest (None: not checked
        here, no manifest or it could not be read); `fresh` as for `LiveLedger.facts` (the
        alerts are evaluated on the newest version)."""
        check = self.integrity
        fp = None if check is None else check.fingerprint
        if fp is None:
            return None
        # Cached under the ledger version and the checks' generation (a catch-up adds checks
        # without a new file): 5 ms of queries at 72,000 files, once, not on every summary.
        return self.live.answer(("integrity", run_id, fp, check.generation), run_id,
                                lambda snap: integrity_totals(snap.cur, snap.run, fp),
                                fresh=fresh, asked=not fresh)

    def newest_report(self, run_id: str) -> dict[str, Any]:
        """The newest reconcile report of a run: under --reports, or the live one."""
        return self.newest_report_file(run_id)[1]

    def newest_report_file(self, run_id: str) -> tuple[Path, dict[str, Any]]:
        """The newest report.json of a run (its path, read) and what it says; its report.html
        lies beside it."""
        reports = self.settings.reports
        if reports is None and self.findings is None:
            raise Unavailable("no reports directory: start the service with --reports DIR "
                              "(where `tally reconcile -o DIR` writes), or with --manifest so "
                              "that it reconciles the run itself")
        best = None
        places = [] if reports is None else [reports / "report.json",
                                             *reports.glob("*/report.json")]
        if self.findings is not None:
            places.append(self.findings.work / run_id / "report.json")
        for p in places:
            try:
                rep = json.loads(p.read_text())
                mtime = p.stat().st_mtime
            except (OSError, ValueError):
                continue
            if isinstance(rep, dict) and rep.get("run_id") == run_id and (
                    best is None or mtime > best[0]):
                best = (mtime, p, rep)
        if best is None:
            raise NotFound(f"no reconcile report for run {run_id!r} yet")
        return best[1], best[2]

    def after_round(self) -> None:
        self.check_alerts()
        self.live.warm()

    def check_alerts(self) -> None:
        for run_id in self.live.run_ids():
            self.webhook.update(run_id, self.summary(run_id, fresh=True)["alerts"])


class FiniteJSONResponse(JSONResponse):
    """JSON with every non-finite float as null: a NaN loss is a value JSON cannot hold, and
    must not turn an answer into a server error."""

    def render(self, content: Any) -> bytes:
        return json.dumps(finite(jsonable_encoder(content)), ensure_ascii=False,
                          allow_nan=False, separators=(",", ":")).encode()


def finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def encode(value: Any) -> bytes:
    return FiniteJSONResponse(value).body


def answer(value: Any, headers: dict[str, str] | None = None) -> Response:
    """An answer as it was computed: encoded once, never filtered through its model."""
    return Response(encode(value), media_type="application/json", headers=headers)
