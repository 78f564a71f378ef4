"""The live API (FastAPI): routes over the live ledger (audit.ledger.live), which owns the
snapshots, the cached answers and the ingest loop; the answers themselves are
audit.ledger.queries. One process owns the ledger: a background thread ingests the spool while
request handlers read, each request inside one snapshot transaction (so an answer never sees
half a segment file)."""

from __future__ import annotations

import contextlib
import hmac
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

from fastapi import FastAPI, Query, Request
from fastapi import Path as PathParam
from fastapi.encoders import jsonable_encoder
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response

from api.alerts import Thresholds, Webhook, evaluate, status
from api.findings import LiveFindings
from api.posthoc_routes import add_routes as add_posthoc_routes
from api.preflight_routes import add_routes as add_preflight_routes
from audit.core.errors import NotFound, TallyError, Unavailable
from audit.hook.spool import RUN_ID_PATTERN
from audit.ledger import queries as q
from audit.ledger.database import Ledger
from audit.ledger.ingest_loop import IngestLoop
from audit.ledger.live import LiveLedger, Snap
from pipeline.manifest_file import ManifestDomains

DASHBOARD = Path(__file__).with_name("dashboard.html")
MAX_STEP = 2**62
SWITCH_INTERVAL = 0.0005  # seconds; see lifespan()

RunId = Annotated[str, PathParam(pattern=RUN_ID_PATTERN, description="run id")]
Step = Annotated[int | None, Query(ge=0, le=MAX_STEP)]
Bucket = Annotated[int | None, Query(ge=1, le=MAX_STEP, description="steps per bucket")]
Points = Annotated[int, Query(ge=1, le=q.MAX_POINTS,
                              description="about this many buckets when bucket is not given")]
ERRORS = {404: {"description": "unknown run, host or record"},
          409: {"description": "needs something the service was not given (a manifest)"}}


class Service:
    """What the routes share: the live ledger (snapshots and cached answers), the ingest loop,
    and the settings the service was started with."""

    def __init__(self, ledger: Ledger, *, spool: Path | None, manifest: ManifestDomains | None,
                 records: int | None, reports: Path | None, thresholds: Thresholds,
                 webhook: str | None, interval: float, checkpoints: list[str] | None = None,
                 preflight_seconds: float = 120.0, max_round_seconds: float = 60.0,
                 findings_every: float | None = None) -> None:
        if manifest is not None:
            uni = q.Universe(manifest.train_records, "manifest")
        elif records is not None:
            uni = q.Universe(records, "records option")
        else:
            uni = q.Universe(None, "unknown")
        self.ledger = ledger
        self.live = LiveLedger(ledger, uni)
        self.manifest = manifest
        self.reports = reports
        self.thresholds = thresholds
        self.webhook = Webhook(webhook)
        self.loop = (IngestLoop(ledger, spool, interval=interval, after_round=self.after_round,
                                max_round_seconds=max_round_seconds)
                     if spool is not None else None)
        self.checkpoints = checkpoints or []
        self.preflight_seconds = preflight_seconds
        # Live findings: reconcile re-run over the spool, with the manifest (api.findings).
        self.findings = None
        if findings_every and spool is not None and manifest is not None:
            self.findings = LiveFindings(spool, manifest.path,
                                         Path(f"{ledger.path}.findings"), findings_every,
                                         self._versions)

    def _versions(self) -> dict[str, int]:
        with self.live.read() as snap:
            return q.run_versions(snap.cur)

    def json(self, key: tuple, run_id: str | None, compute: Callable[[Snap], Any], *,
             outside: bool = False) -> Response:
        """A cached answer as a JSON response (encoded once per ledger version)."""
        body = self.live.answer(key, run_id, lambda snap: _encode(compute(snap)),
                                outside=outside)
        return Response(body, media_type="application/json")

    def summary(self, run_id: str) -> dict[str, Any]:
        f = self.live.facts(run_id)
        t, cov = f["totals"], f["coverage"]
        n = cov["train_records"]
        first_pass = n is None or cov["exposures"] <= n
        lag = self.loop.lag_seconds() if self.loop is not None else 0.0
        live = None if self.findings is None else self.findings.summary(run_id)
        alerts = evaluate(self.thresholds, epoch_duplicates=t["epoch_duplicates"],
                          multi_host_records=t["multi_host_records"], first_pass=first_pass,
                          lag_seconds=lag, behind=cov.get("behind_ideal"),
                          non_finite_losses=t["non_finite_losses"]["count"], findings=live)
        return {"run_id": run_id, "status": status(alerts), "alerts": alerts,
                "last_step": cov["latest_step"], **t,
                "state": "finished" if t["finished"] else "running", "coverage": cov,
                "ingest_lag_seconds": lag, "quarantined_files": self.live.quarantined(run_id),
                "findings": live}

    def newest_report(self, run_id: str) -> dict[str, Any]:
        """The newest reconcile report of a run: under --reports, or the live one."""
        if self.reports is None and self.findings is None:
            raise Unavailable("no reports directory: start the service with --reports DIR "
                              "(where `tally reconcile -o DIR` writes), or with --manifest so "
                              "that it reconciles the run itself")
        best = None
        places = [] if self.reports is None else [self.reports / "report.json",
                                                  *self.reports.glob("*/report.json")]
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
                best = (mtime, rep)
        if best is None:
            raise NotFound(f"no reconcile report for run {run_id!r} yet")
        return best[1]

    def after_round(self) -> None:
        self.check_alerts()
        self.live.warm()

    def check_alerts(self) -> None:
        for run_id in self.live.run_ids():
            self.webhook.update(run_id, self.summary(run_id)["alerts"])


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


def _encode(value: Any) -> bytes:
    return FiniteJSONResponse(value).body


class BearerToken:
    """Every request needs `Authorization: Bearer <token>`; a query token opens the dashboard
    page only, which a browser opens by URL (its own requests then send the header). Tokens
    are compared in constant time. A plain ASGI middleware: it leaves the request's receive
    channel alone, so a handler still learns when its client goes away."""

    def __init__(self, app: Any, token: str) -> None:
        self.app, self.token = app, token.encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request = Request(scope)
        got = request.headers.get("authorization", "")
        given = got[7:] if got.lower().startswith("bearer ") else ""
        if not given and scope["path"] == "/" and scope["method"] == "GET":
            given = request.query_params.get("token", "")
        if hmac.compare_digest(given.encode(), self.token):
            return await self.app(scope, receive, send)
        response = JSONResponse({"detail": "missing or wrong bearer token"}, status_code=401,
                                headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


def check_settings(*, spool: str | Path | None = None, manifest: str | Path | None = None,
                   records: int | None = None, reports: str | Path | None = None,
                   checkpoints: list[str] | None = None) -> ManifestDomains | None:
    """The service's arguments, checked before anything is opened or created (TallyError
    saying which is wrong); returns the manifest's domains when a manifest is given."""
    if spool is not None and not Path(spool).is_dir():
        raise TallyError(f"spool {spool} is not a directory")
    if records is not None and records < 1:
        raise TallyError("--records must be >= 1")
    if reports is not None and Path(reports).exists() and not Path(reports).is_dir():
        raise TallyError(f"reports {reports} is not a directory")  # it may be made later
    for c in checkpoints or []:
        if not Path(c).is_dir():
            raise TallyError(f"--checkpoints {c} is not a directory")
    return None if manifest is None else ManifestDomains.load(manifest)


def create_app(ledger: Ledger, *, spool: str | Path | None = None,
               manifest: str | Path | None = None, records: int | None = None,
               reports: str | Path | None = None, token: str | None = None,
               thresholds: Thresholds | None = None, webhook: str | None = None,
               interval: float = 1.0, checkpoints: list[str] | None = None,
               preflight_seconds: float = 120.0, max_round_seconds: float = 60.0,
               findings_every: float | None = None) -> FastAPI:
    """The app over an open, writable ledger; with `spool`, it ingests while it serves.
    Checks its arguments (`check_settings`) first."""
    domains = check_settings(spool=spool, manifest=manifest, records=records,
                             reports=reports, checkpoints=checkpoints)
    svc = Service(ledger, spool=None if spool is None else Path(spool), manifest=domains,
                  records=records, reports=None if reports is None else Path(reports),
                  thresholds=thresholds or Thresholds(), webhook=webhook, interval=interval,
                  checkpoints=checkpoints, preflight_seconds=preflight_seconds,
                  max_round_seconds=max_round_seconds, findings_every=findings_every)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        # A request hands the GIL back and forth a few dozen times (event loop, worker thread,
        # each DuckDB call); with the default 5 ms switch interval each hand-back can wait that
        # long behind the ingester's Python work, which made the p99 latency 5-10x the p50.
        switch = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_INTERVAL)
        if svc.loop is not None:
            svc.loop.start()
        if svc.findings is not None:
            svc.findings.start()
        try:
            yield
        finally:
            if svc.findings is not None:
                svc.findings.stop()
            if svc.loop is not None:
                svc.loop.stop()
            # A clean stop leaves the per-record state's snapshot current enough for a restart
            # in seconds (audit.ledger.snapshot); a kill leaves the last one, which catches up.
            # A state dropped meanwhile (invalidated) is not reloaded only to be saved.
            agg = getattr(ledger, "_aggregates", None)
            if agg is not None:
                agg.save(ledger, final=True)
            sys.setswitchinterval(switch)

    app = FastAPI(title="Tally live API", version="1",
                  description="What a training run has consumed, while it runs: coverage and "
                              "duplication per step and per host, record lookups, alerts.",
                  lifespan=lifespan, default_response_class=FiniteJSONResponse)
    app.state.service = svc

    if token is not None:
        app.add_middleware(BearerToken, token=token)

    add_preflight_routes(app, svc, RunId, ERRORS)
    add_posthoc_routes(app, svc, RunId, Points, ERRORS)

    @app.exception_handler(NotFound)
    async def not_found(request: Request, exc: NotFound):
        return JSONResponse({"detail": str(exc)}, status_code=404)

    @app.exception_handler(Unavailable)
    async def unavailable(request: Request, exc: Unavailable):
        return JSONResponse({"detail": str(exc)}, status_code=409)

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def dashboard() -> HTMLResponse:
        return HTMLResponse(DASHBOARD.read_text())

    @app.get("/healthz", tags=["service"])
    def healthz() -> dict[str, Any]:
        """Liveness, and how the ingester is doing."""
        loop = svc.loop
        files = svc.live.files_in_ledger()
        overran = loop is not None and loop.overran() is not None
        ok = loop is None or (loop.alive and loop.last_error is None and not overran)
        return {"status": "ok" if ok else "degraded", "ledger": str(ledger.path),
                "files_in_ledger": files, "ingesting": loop is not None,
                "quarantined_files": svc.live.quarantine_counts(),
                "ingest": None if loop is None else {
                    "alive": loop.alive, "rounds": loop.rounds, "files": loop.files,
                    "rows": loop.rows, "quarantined": loop.quarantined,
                    "last_error": loop.last_error, "lag_seconds": loop.lag_seconds(),
                    "overran": loop.overran(), "max_round_seconds": loop.max_round_seconds},
                "universe": {"train_records": svc.live.uni.n, "source": svc.live.uni.source},
                "thresholds": svc.thresholds.as_dict(),
                "webhook": {"configured": svc.webhook.url is not None,
                            "sent": svc.webhook.sent, "failures": svc.webhook.failures}}

    @app.get("/v1/runs", tags=["runs"])
    def list_runs() -> list[dict[str, Any]]:
        """Every run in the ledger with its size and latest step."""
        return svc.json(("runs",), None, lambda snap: q.runs(snap.cur))

    @app.get("/v1/runs/{run_id}", tags=["runs"], responses=ERRORS)
    def run_summary(run_id: RunId) -> dict[str, Any]:
        """Coverage, duplicates, hosts, restarts and the alert status of one run."""
        return svc.summary(run_id)

    @app.get("/v1/runs/{run_id}/coverage", tags=["coverage"], responses=ERRORS)
    def run_coverage(run_id: RunId, step: Step = None) -> dict[str, Any]:
        """Coverage, exposure histogram (0, 1, 2, 3+) and the ideal, as of a step (default:
        the latest)."""
        return svc.json(("coverage", run_id, step), run_id, lambda snap: q.coverage(
            snap.cur, snap.run, snap.uni, step, snap.outside), outside=True)

    @app.get("/v1/runs/{run_id}/steps", tags=["coverage"], responses=ERRORS)
    def run_steps(run_id: RunId, start: Step = None, end: Step = None, bucket: Bucket = None,
                  points: Points = 500) -> dict[str, Any]:
        """Per step, bucketed: consumed, new unique, repeats, cumulative coverage, ideal."""
        return svc.json(("steps", run_id, start, end, bucket, points), run_id,
                        lambda snap: q.steps(snap.cur, snap.run, snap.uni, start, end, bucket,
                                             points))

    @app.get("/v1/runs/{run_id}/hosts", tags=["hosts"], responses=ERRORS)
    def run_hosts(run_id: RunId) -> dict[str, Any]:
        """Per-host stats and the host x host overlap matrix."""
        return svc.json(("hosts.json", run_id), run_id,
                        lambda snap: q.hosts(snap.cur, snap.run))

    @app.get("/v1/runs/{run_id}/hosts/{host}/steps", tags=["hosts"], responses=ERRORS)
    def run_host_steps(run_id: RunId, host: Annotated[int, PathParam(ge=0, le=2**31 - 1)],
                       start: Step = None, end: Step = None, bucket: Bucket = None,
                       points: Points = 500) -> dict[str, Any]:
        """One host's per-step series, bucketed."""
        return svc.json(("host_steps", run_id, host, start, end, bucket, points), run_id,
                        lambda snap: q.host_steps(snap.cur, snap.run, host, start, end, bucket,
                                                  points))

    @app.get("/v1/runs/{run_id}/records/{record_key}", tags=["records"], responses=ERRORS)
    def run_record(run_id: RunId,
                   record_key: Annotated[int, PathParam(ge=0, le=2**63 - 1)]) -> dict[str, Any]:
        """Every consumption of one record: step, host, attempt, epoch, rolled back or not."""
        with svc.live.read(run_id) as snap:
            return q.record(snap.cur, snap.run, record_key=record_key)

    @app.get("/v1/runs/{run_id}/records", tags=["records"], responses=ERRORS)
    def run_record_by_hash(
            run_id: RunId,
            content_hash: Annotated[str, Query(pattern=r"^(0x[0-9a-fA-F]{1,16}|[0-9]{1,20})$",
                                               description="xxh3_64, decimal or 0x-hex")],
    ) -> dict[str, Any]:
        """Every consumption of the records with this content hash."""
        h = int(content_hash, 0) if content_hash.startswith("0x") else int(content_hash)
        with svc.live.read(run_id) as snap:
            if h >= 2**64:  # a well-formed number, but no xxh3_64 value: no record has it
                raise NotFound(f"no record has content hash {content_hash} (xxh3_64 values "
                                 "are below 2**64)")
            return q.record(snap.cur, snap.run, content_hash=h)

    @app.get("/v1/runs/{run_id}/domains", tags=["coverage"], responses=ERRORS)
    def run_domains(run_id: RunId) -> list[dict[str, Any]]:
        """Per domain (from the manifest): planned vs actual share of exposures, coverage."""
        if svc.manifest is None:
            raise Unavailable("per-domain exposure needs the manifest: start the service "
                              "with --manifest")
        return q.domains(svc.live.record_exposures(run_id), svc.manifest)

    @app.get("/v1/runs/{run_id}/metrics", tags=["metrics"], responses=ERRORS)
    def run_metrics(run_id: RunId, points: Points = 500) -> dict[str, Any]:
        """Milestones (held-out loss, per-domain perplexity) against train loss."""
        return svc.json(("metrics", run_id, points), run_id,
                        lambda snap: q.metrics(snap.cur, snap.run, points))

    @app.get("/v1/runs/{run_id}/report", tags=["runs"], responses=ERRORS)
    def run_report(run_id: RunId) -> dict[str, Any]:
        """The latest reconcile report (report.json) of this run: under --reports, or the live
        one the service keeps current (with --manifest and --spool)."""
        return svc.newest_report(run_id)

    @app.get("/v1/runs/{run_id}/loss", tags=["metrics"], responses=ERRORS)
    def run_loss(run_id: RunId) -> dict[str, Any]:
        """Training loss split by exposure: per window of steps, the mean loss of due
        exposures and of repeated ones (beyond what a perfect loader allows), the held-out
        loss at the milestones, and the test of whether repeats flattered the loss; from the
        newest reconcile report of the run (per-segment losses in the spool)."""
        rep = svc.newest_report(run_id)
        return {"as_of_step": (rep.get("consumption") or {}).get("last_step"),
                "generated_at": rep.get("generated_at"), **(rep.get("loss") or {})}

    @app.get("/metrics", response_class=PlainTextResponse, tags=["service"])
    def prometheus() -> PlainTextResponse:
        """Prometheus text format: coverage, duplicate fractions, ingest lag, rows, per host."""
        return PlainTextResponse(_prometheus(svc),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def _prometheus(svc: Service) -> str:
    out: dict[str, tuple[str, list[str]]] = {}

    def add(name: str, help_: str, value: float | None, **labels: Any) -> None:
        if value is None:
            return
        lab = ",".join(f'{k}="{v}"' for k, v in labels.items())
        out.setdefault(name, (help_, []))[1].append(
            f"{name}{{{lab}}} {float(value):.10g}" if lab else f"{name} {float(value):.10g}")

    lag = svc.loop.lag_seconds() if svc.loop is not None else 0.0
    add("tally_ingest_lag_seconds", "Age of the oldest spool file waiting for ingest", lag)
    if svc.loop is not None:
        add("tally_ingest_rounds_total", "Ingest rounds of this process", svc.loop.rounds)
        add("tally_quarantined_files_total", "Files quarantined by this process",
            svc.loop.quarantined)
    for run_id in svc.live.run_ids():
        s, hs = svc.summary(run_id), svc.live.hosts(run_id)
        host_rows = svc.live.host_rows(run_id)
        c = s["coverage"]
        add("tally_coverage", "Share of train records seen at least once", c["coverage"],
            run=run_id)
        add("tally_ideal_coverage", "Coverage a perfect loader would have now",
            c.get("ideal", {}).get("coverage"), run=run_id)
        add("tally_exposures", "Effective record exposures", c["exposures"], run=run_id)
        add("tally_records_seen", "Distinct records seen", s["records_seen"], run=run_id)
        ex = max(1, s["exposures"])
        add("tally_repeat_fraction", "Share of exposures that repeat a record already seen",
            (s["exposures"] - s["records_seen"]) / ex, run=run_id)
        add("tally_epoch_duplicate_fraction",
            "Share of exposures that repeat a record within one epoch",
            s["epoch_duplicates"] / ex, run=run_id)
        add("tally_epoch_duplicates", "Exposures beyond the first of a record in one epoch",
            s["epoch_duplicates"], run=run_id)
        add("tally_multi_host_records", "Records seen by two or more hosts",
            s["multi_host_records"], run=run_id)
        add("tally_rows_ingested_total", "Segment rows in the ledger", s["rows_ingested"],
            run=run_id)
        add("tally_last_step", "Latest effective step", s["last_step"], run=run_id)
        for a in s["alerts"]:
            add("tally_alert", "1 when the alert fires", int(a["firing"]), run=run_id,
                alert=a["name"])
        integ = (s.get("findings") or {}).get("integrity")
        for key in ("hash_mismatches", "unknown_keys", "unknown_segments",
                    "heldout_consumed_records", "heldout_exposures") if integ else ():
            add("tally_integrity", "Integrity against the manifest, as the live reconcile "
                "found it", integ[key], run=run_id, kind=key)
        for h in hs["per_host"]:
            lab = {"run": run_id, "host": h["host"]}
            add("tally_host_rows_ingested_total", "Segment rows in the ledger, per host",
                host_rows.get(h["host"], 0), **lab)
            add("tally_host_exposures", "Effective exposures per host", h["exposures"], **lab)
            add("tally_host_unique_records", "Distinct records per host", h["unique"], **lab)
            add("tally_host_shared_records", "Records a host saw that another host saw too",
                h["overlap_with_others"], **lab)
            add("tally_host_last_step", "Latest effective step per host", h["last_step"], **lab)
    lines = []
    for name, (help_, samples) in out.items():
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} gauge", *samples]
    return "\n".join(lines) + "\n"
