"""The service's own routes: the dashboard, liveness (/healthz) and the Prometheus scrape
(/metrics, tally.api.metrics)."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, Response

from tally.api import models
from tally.api.metrics import Exposition
from tally.api.service import Service, answer
from tally.audit.render import vocabulary

DASHBOARD = Path(__file__).with_name("dashboard.html")


def add_routes(app: FastAPI, svc: Service, scrape: Exposition) -> None:
    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def dashboard() -> HTMLResponse:
        return HTMLResponse(vocabulary.inject(DASHBOARD.read_text()))  # titles, colours

    @app.get("/healthz", tags=["service"], response_model=models.Health)
    def healthz() -> Response:
        """Liveness, and how the ingester is doing."""
        loop = svc.loop
        files = svc.live.files_in_ledger()
        overran = loop is not None and loop.overran() is not None
        ok = loop is None or (loop.alive and loop.last_error is None and not overran)
        ok = ok and svc.webhook.alive  # a dead sender delivers no alert again
        integrity_error = None if svc.integrity is None else svc.integrity.error
        ok = ok and integrity_error is None  # integrity alerts cannot fire without the check
        return answer({"status": "ok" if ok else "degraded", "ledger": str(svc.ledger.path),
                "files_in_ledger": files, "ingesting": loop is not None,
                "quarantined_files": svc.live.quarantine_counts(),
                "ingest": None if loop is None else {
                    "alive": loop.alive, "rounds": loop.rounds, "files": loop.files,
                    "rows": loop.rows, "quarantined": loop.quarantined,
                    "last_error": loop.last_error, "lag_seconds": loop.lag_seconds(),
                    "catching_up": loop.catching_up,
                    "overran": loop.overran(), "max_round_seconds": loop.max_round_seconds,
                    "integrity_error": integrity_error},
                "universe": {"train_records": svc.live.uni.n, "source": svc.live.uni.source},
                "thresholds": svc.settings.thresholds.as_dict(),
                "webhook": {"configured": svc.webhook.url is not None,
                            "alive": svc.webhook.alive, "error": svc.webhook.error,
                            "sent": svc.webhook.sent, "failures": svc.webhook.failures,
                            "pending": svc.webhook.pending}})

    scrape_example = '# TYPE tally_coverage_ratio gauge\ntally_coverage_ratio{run="exp1"} 0.9067\n'

    @app.get("/metrics", tags=["service"], response_class=Response, responses={
        200: {"description": "Prometheus text format, or OpenMetrics when the scraper asks",
              "content": {"text/plain": {"schema": {"type": "string"},
                                         "example": scrape_example}}}})
    def scrape_metrics(request: Request) -> Response:
        """Coverage and duplicate ratios, ingest lag, rows ingested, alerts, per-host series
        (`--metrics-hosts`), request latency per route, process metrics and
        `tally_build_info`, for Prometheus (api/metrics.py)."""
        body, content_type = scrape(request.headers.get("accept"))
        return Response(body, media_type=content_type)

