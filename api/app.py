"""The live API (FastAPI): routes over the live ledger (tally.audit.ledger.live), which owns the
snapshots, the cached answers and the ingest loop; the answers themselves are
tally.audit.ledger.queries. One process owns the ledger: a background thread ingests the spool while
request handlers read, each request inside one snapshot transaction (so an answer never sees
half a segment file)."""

from __future__ import annotations

import base64
import contextlib
import hmac
import json
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

from fastapi import FastAPI, Query, Request
from fastapi import Path as PathParam
from fastapi.encoders import jsonable_encoder
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException

from tally.api import docs, errors, models
from tally.api.alerts import Thresholds, Webhook, check_webhook, evaluate, status
from tally.api.findings import LiveFindings
from tally.api.metrics import Exposition, RequestTimer
from tally.api.posthoc_routes import add_routes as add_posthoc_routes
from tally.api.preflight_routes import add_routes as add_preflight_routes
from tally.audit.core.errors import NotFound, TallyError, Unavailable
from tally.audit.core.schema import MAX_STEP, RUN_ID_PATTERN
from tally.audit.ledger import queries as q
from tally.audit.ledger.database import Ledger
from tally.audit.ledger.ingest_loop import IngestLoop
from tally.audit.ledger.live import LiveLedger, Snap
from tally.audit.reconcile.html import served
from tally.audit.render import vocabulary
from tally.pipeline.manifest_file import ManifestDomains

DASHBOARD = Path(__file__).with_name("dashboard.html")
# What a browser opens by URL, so that a `?token=` opens it too: the pages, and the answers
# report.html's evidence links open (tally.audit.reconcile.html.served carries the page's token).
PAGES = re.compile(r"/|/runs/[^/]+/report\.html"
                   r"|/v1/runs/[^/]+/(steps|hosts/\d+/steps|records/\d+)")
# Request bodies: a pre-flight request is a few hundred bytes, an exposure request of
# MAX_HASHES hashes about 250 KB. A 1 GB body was read, parsed and answered 200 (+3 GB).
MAX_BODY_BYTES = 1 << 20
SWITCH_INTERVAL = 0.0005  # seconds; see lifespan()

RunId = Annotated[str, PathParam(pattern=RUN_ID_PATTERN, description="run id")]
Step = Annotated[int | None, Query(ge=0, le=MAX_STEP)]
Bucket = Annotated[int | None, Query(ge=1, le=MAX_STEP, description="steps per bucket")]
Points = Annotated[int, Query(ge=1, le=q.MAX_POINTS,
                              description="about this many buckets when bucket is not given")]
RecordCursor = Annotated[str | None, Query(
    pattern=q.RECORD_CURSOR, description="where the previous page ended: its `next_cursor` "
                                         "(the Link header's rel=next URL carries it too)")]
# A runs page's cursor: base64url of "r:" and the last run id of the page (see _run_cursor).
# The pattern is exactly what decodes to that prefix and a position (base64 of any length but
# 1 modulo 4), so that a cursor the schema accepts is one the route accepts.
B64 = "[A-Za-z0-9_-]"
RUN_CURSOR = rf"^cj[o-r](?:{B64}{{4}}){{0,100}}(?:{B64}|{B64}{{3}})?$"
RunCursor = Annotated[str | None, Query(
    pattern=RUN_CURSOR, description="where the previous page ended, opaque: the previous "
                                    "page's Link header, rel=next, carries it")]
ERRORS = errors.responses(404, 409, 422)
# Pages: an array answer says where the next page starts in a Link header (RFC 8288, as
# GitHub's API does); an object answer also in its `next_cursor`.
NEXT_PAGE = {"headers": {"Link": {"description": '`<URL>; rel="next"` while more pages follow',
                                  "schema": {"type": "string"}}}}


def page_limit(default: int, most: int) -> Any:
    return Annotated[int, Query(ge=1, le=most, description=f"rows per page (default {default})")]


RunsLimit = page_limit(100, 1000)
RecordLimit = page_limit(1000, 10_000)
# Buckets of a step series: `points` never asks for more than one page of them, an explicit
# `bucket` may (bucket=1 over 2M steps was one answer of 97 MB, 66 s and 1.7 GB at its peak).
StepsLimit = page_limit(q.MAX_POINTS, q.MAX_POINTS)
StepCursor = Annotated[int | None, Query(
    ge=0, le=MAX_STEP, description="the first step of this page: the previous page's "
                                   "`next_cursor` (the Link header's rel=next URL carries it)")]


def _next_page_link(request: Request, cursor: str | None, **pinned: Any) -> dict[str, str]:
    """The Link header naming the next page (`pinned`: parameters the next page must repeat
    as this one resolved them), or none on the last page."""
    if cursor is None:
        return {}
    url = request.url.include_query_params(cursor=cursor, **pinned)
    return {"Link": f'<{url}>; rel="next"'}


def _run_cursor(run_id: str) -> str:
    """The runs page cursor after this run: opaque (base64url), so that a client follows the
    Link header instead of building one from a run id (which would tie us to run-id order)."""
    return base64.urlsafe_b64encode(f"r:{run_id}".encode()).rstrip(b"=").decode()


def _after_run(cursor: str | None) -> str | None:
    """Where a runs page cursor says the page starts: after this text in run-id order (the
    pattern, RUN_CURSOR, refuses anything else with a 422)."""
    if cursor is None:
        return None
    raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
    return raw[2:].decode(errors="replace")


def _check_span(start: int | None, end: int | None) -> None:
    """`start` after `end` is a 422 (it answered an empty series, as if the run had none)."""
    if start is not None and end is not None and start > end:
        raise errors.invalid("query", "end", f"end ({end}) is before start ({start})",
                             "range")


def _step_page(found: dict[str, Any]) -> tuple[bytes, tuple[int, int] | None]:
    """A page of a step series, encoded once (cached per ledger version), and where the next
    page starts with its bucket size (None on the last)."""
    nxt = found["next_cursor"]
    return _encode(found), None if nxt is None else (nxt, found["bucket"])


def _paged(limit: int, cursor: int | None) -> tuple[int | None, ...]:
    """A step series' page in its cache key: nothing for the first page of the default size
    (the key the answer had before pages)."""
    return () if (limit, cursor) == (q.MAX_POINTS, None) else (limit, cursor)


def _step_link(request: Request, nxt: tuple[int, int] | None) -> dict[str, str]:
    # The bucket size is pinned in the next page's URL: with `points` alone it follows the
    # run's last step, which moves while the run is ingested, and pages would not align.
    return {} if nxt is None else _next_page_link(request, str(nxt[0]), bucket=nxt[1])


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
        self.live.revalidate = spool is not None  # the ingest loop refreshes the answers
        self.manifest = manifest
        self.reports = reports
        self.thresholds = thresholds
        self.webhook = Webhook(webhook)
        self.loop = (IngestLoop(ledger, spool, interval=interval, after_round=self.after_round,
                                max_round_seconds=max_round_seconds)
                     if spool is not None else None)
        self.checkpoints = checkpoints or []
        self.preflight_seconds = preflight_seconds
        # Live findings: reconcile re-run over the spool, with the manifest (tally.api.findings).
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

    def summary(self, run_id: str, *, fresh: bool = False) -> dict[str, Any]:
        f = self.live.facts(run_id, fresh=fresh)
        t, cov = f["totals"], f["coverage"]
        n = cov["train_records"]
        first_pass = n is None or cov["exposures"] <= n
        lag = self.loop.lag_seconds() if self.loop is not None else 0.0
        catching_up = self.loop is not None and self.loop.catching_up
        live = None if self.findings is None else self.findings.summary(run_id)
        alerts = evaluate(self.thresholds, epoch_duplicates=t["epoch_duplicates"],
                          multi_host_records=t["multi_host_records"], first_pass=first_pass,
                          lag_seconds=lag, behind=cov.get("behind_ideal"),
                          non_finite_losses=t["non_finite_losses"]["count"], findings=live,
                          catching_up=catching_up)
        return {"run_id": run_id, "status": status(alerts), "alerts": alerts,
                "last_step": cov["latest_step"], **t,
                "state": "finished" if t["finished"] else "running", "coverage": cov,
                "ingest_lag_seconds": lag, "ingest_state": None if self.loop is None else
                "catching up" if catching_up else "live",
                "quarantined_files": self.live.quarantined(run_id),
                "findings": live}

    def newest_report(self, run_id: str) -> dict[str, Any]:
        """The newest reconcile report of a run: under --reports, or the live one."""
        return self.newest_report_file(run_id)[1]

    def newest_report_file(self, run_id: str) -> tuple[Path, dict[str, Any]]:
        """The newest report.json of a run (its path, read) and what it says; its report.html
        lies beside it."""
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


def _encode(value: Any) -> bytes:
    return FiniteJSONResponse(value).body


class BearerToken:
    """Every request needs `Authorization: Bearer <token>`; a query token opens only what a
    browser opens by URL (PAGES: the dashboard, a run's report.html and the answers its
    evidence links open; the dashboard's own requests then send the header). Tokens
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
        if not given and scope["method"] == "GET" and PAGES.fullmatch(scope["path"]):
            given = request.query_params.get("token", "")
        if not given and docs.OPEN.fullmatch(scope["path"]):  # the schema and its pages
            return await self.app(scope, receive, send)
        if hmac.compare_digest(given.encode(), self.token):
            return await self.app(scope, receive, send)
        response = errors.problem(401, "missing or wrong bearer token",
                                  headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


class BodyLimit:
    """Request bodies of at most `limit` bytes: a larger Content-Length is answered 413 before
    a byte of the body is read; a body without one (chunked) is counted as it arrives and
    answered 413 once it passes the limit. A plain ASGI middleware, as BearerToken."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit
        self.detail = f"the request body is larger than {limit:,} bytes, the most this " \
                      "service reads"

    def _too_large(self) -> Response:
        return errors.problem(413, self.detail)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = Headers(scope=scope).get("content-length", "")
        if length.isdigit() and int(length) > self.limit:
            return await self._too_large()(scope, receive, send)
        seen = 0

        async def counted() -> dict:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:  # FastAPI answers it with errors' handler
                    raise HTTPException(413, self.detail)
            return message

        watched = errors.WatchedSend(send)
        try:
            await self.app(scope, counted, watched)
        except HTTPException as exc:  # raised where no handler answers it (a middleware)
            if exc.status_code != 413 or watched.started:
                raise
            await self._too_large()(scope, receive, send)


def check_settings(*, spool: str | Path | None = None, manifest: str | Path | None = None,
                   records: int | None = None, reports: str | Path | None = None,
                   checkpoints: list[str] | None = None,
                   webhook: str | None = None) -> ManifestDomains | None:
    """The service's arguments, checked before anything is opened or created (TallyError
    saying which is wrong); returns the manifest's domains when a manifest is given."""
    check_webhook(webhook)
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
               findings_every: float | None = None,
               metrics_hosts: int | None = None) -> FastAPI:
    """The app over an open, writable ledger; with `spool`, it ingests while it serves.
    Checks its arguments (`check_settings`) first. `metrics_hosts`: per-host series in
    /metrics for this many hosts of each run, those with the most repeats (None: all)."""
    domains = check_settings(spool=spool, manifest=manifest, records=records,
                             reports=reports, checkpoints=checkpoints, webhook=webhook)
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
            svc.live.close()
            # A clean stop leaves the per-record state's snapshot current enough for a restart
            # in seconds (tally.audit.ledger.snapshot); a kill leaves the last one, which catches
            # up.
            # A state dropped meanwhile (invalidated) is not reloaded only to be saved.
            agg = ledger._aggregates
            if agg is not None:
                agg.save(ledger, final=True)
            svc.webhook.close()
            sys.setswitchinterval(switch)

    app = FastAPI(title="Tally live API", version="1",
                  description="What a training run has consumed, while it runs: coverage and "
                              "duplication per step and per host, record lookups, alerts. "
                              "Every error answers in one shape (`Problem`).",
                  lifespan=lifespan, default_response_class=FiniteJSONResponse,
                  docs_url=None, redoc_url=None,
                  generate_unique_id_function=docs.operation_id)
    app.state.service = svc
    docs.install(app)  # /docs and /redoc, offline
    scrape = Exposition(svc, hosts=metrics_hosts)
    ERRORS = errors.responses(404, 409, 422)

    # Middleware added last runs first: errors' catch-all, the request timer, the body limit,
    # then the token.
    if token is not None:
        app.add_middleware(BearerToken, token=token)
        docs.secure(app)  # the bearer scheme, and 401, on every operation of the schema
    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES)
    app.add_middleware(RequestTimer, histogram=scrape.latency)
    errors.install(app)

    add_preflight_routes(app, svc, RunId, ERRORS)
    add_posthoc_routes(app, svc, RunId, Points, ERRORS)

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def dashboard() -> HTMLResponse:
        return HTMLResponse(vocabulary.inject(DASHBOARD.read_text()))  # titles, colours

    @app.get("/runs/{run_id}/report.html", response_class=HTMLResponse,
             include_in_schema=False)
    def report_page(request: Request, run_id: RunId) -> HTMLResponse:
        """The newest report.html of a run (beside its newest report.json), its evidence links
        opening this service's API with the token the page was opened with."""
        path, _ = svc.newest_report_file(run_id)
        try:
            page = path.with_name("report.html").read_text()
        except OSError as exc:
            raise NotFound(f"run {run_id!r} has a report.json without a report.html") from exc
        return HTMLResponse(vocabulary.with_tables_script(served(
            page, request.query_params.get("token") if token is not None else None)))

    @app.get("/healthz", tags=["service"], response_model=models.Health)
    def healthz() -> Response:
        """Liveness, and how the ingester is doing."""
        loop = svc.loop
        files = svc.live.files_in_ledger()
        overran = loop is not None and loop.overran() is not None
        ok = loop is None or (loop.alive and loop.last_error is None and not overran)
        ok = ok and svc.webhook.alive  # a dead sender delivers no alert again
        return _json({"status": "ok" if ok else "degraded", "ledger": str(ledger.path),
                "files_in_ledger": files, "ingesting": loop is not None,
                "quarantined_files": svc.live.quarantine_counts(),
                "ingest": None if loop is None else {
                    "alive": loop.alive, "rounds": loop.rounds, "files": loop.files,
                    "rows": loop.rows, "quarantined": loop.quarantined,
                    "last_error": loop.last_error, "lag_seconds": loop.lag_seconds(),
                    "catching_up": loop.catching_up,
                    "overran": loop.overran(), "max_round_seconds": loop.max_round_seconds},
                "universe": {"train_records": svc.live.uni.n, "source": svc.live.uni.source},
                "thresholds": svc.thresholds.as_dict(),
                "webhook": {"configured": svc.webhook.url is not None,
                            "alive": svc.webhook.alive, "error": svc.webhook.error,
                            "sent": svc.webhook.sent, "failures": svc.webhook.failures,
                            "pending": svc.webhook.pending}})

    @app.get("/v1/runs", tags=["runs"], response_model=list[models.RunListItem],
             responses={**errors.responses(422), 200: NEXT_PAGE})
    def list_runs(request: Request, limit: RunsLimit = 100,
                  cursor: RunCursor = None) -> Response:
        """The runs in the ledger, in run-id order, with their size and latest step; a page
        of `limit` at a time (the Link header names the next page)."""
        after = _after_run(cursor)
        found = svc.live.answer(("runs", limit, after), None,
                                lambda snap: q.runs(snap.cur, limit + 1, after))
        page = found[:limit]
        return _json(page, _next_page_link(request, _run_cursor(page[-1]["run_id"])
                                           if len(found) > limit else None))

    @app.get("/v1/runs/{run_id}", tags=["runs"], responses=ERRORS,
             response_model=models.RunSummary)
    def run_summary(run_id: RunId) -> Response:
        """Coverage, duplicates, hosts, restarts and the alert status of one run."""
        return _json(svc.summary(run_id))

    @app.get("/v1/runs/{run_id}/coverage", tags=["coverage"], responses=ERRORS,
             response_model=models.CoverageAnswer)
    def run_coverage(run_id: RunId, step: Step = None) -> Response:
        """Coverage, exposure histogram (0, 1, 2, 3+) and the ideal, as of a step (default:
        the latest)."""
        return svc.json(("coverage", run_id, step), run_id, lambda snap: q.coverage(
            snap.cur, snap.run, snap.uni, step, snap.outside), outside=True)

    @app.get("/v1/runs/{run_id}/steps", tags=["coverage"],
             responses={**ERRORS, 200: NEXT_PAGE}, response_model=models.Steps)
    def run_steps(request: Request, run_id: RunId, start: Step = None, end: Step = None,
                  bucket: Bucket = None, points: Points = 500, limit: StepsLimit = q.MAX_POINTS,
                  cursor: StepCursor = None) -> Response:
        """Per step, bucketed: consumed, new unique, repeats, cumulative coverage, ideal; a
        page of `limit` buckets at a time (the Link header names the next page)."""
        _check_span(start, end)
        body = svc.live.answer(
            ("steps", run_id, start, end, bucket, points, *_paged(limit, cursor)), run_id,
            lambda snap: _step_page(q.steps(snap.cur, snap.run, snap.uni, start, end, bucket,
                                            points, limit, cursor)))
        return Response(body[0], media_type="application/json",
                        headers=_step_link(request, body[1]))

    @app.get("/v1/runs/{run_id}/hosts", tags=["hosts"], responses=ERRORS,
             response_model=models.Hosts)
    def run_hosts(run_id: RunId) -> Response:
        """Per-host stats and the host x host overlap matrix."""
        return svc.json(("hosts.json", run_id), run_id,
                        lambda snap: q.hosts(snap.cur, snap.run))

    @app.get("/v1/runs/{run_id}/hosts/{host}/steps", tags=["hosts"],
             responses={**ERRORS, 200: NEXT_PAGE}, response_model=models.HostSteps)
    def run_host_steps(request: Request, run_id: RunId,
                       host: Annotated[int, PathParam(ge=0, le=2**31 - 1)],
                       start: Step = None, end: Step = None, bucket: Bucket = None,
                       points: Points = 500, limit: StepsLimit = q.MAX_POINTS,
                       cursor: StepCursor = None) -> Response:
        """One host's per-step series, bucketed; a page of `limit` buckets at a time."""
        _check_span(start, end)
        body = svc.live.answer(
            ("host_steps", run_id, host, start, end, bucket, points, *_paged(limit, cursor)),
            run_id,
            lambda snap: _step_page(q.host_steps(snap.cur, snap.run, host, start, end, bucket,
                                                 points, limit, cursor)))
        return Response(body[0], media_type="application/json",
                        headers=_step_link(request, body[1]))

    @app.get("/v1/runs/{run_id}/records/{record_key}", tags=["records"],
             responses={**ERRORS, 200: NEXT_PAGE}, response_model=models.RecordLookup)
    def run_record(request: Request, run_id: RunId,
                   record_key: Annotated[int, PathParam(ge=0, le=2**63 - 1)],
                   limit: RecordLimit = 1000, cursor: RecordCursor = None) -> Response:
        """Every consumption of one record: step, host, attempt, epoch, rolled back or not; a
        page of `limit` at a time."""
        with svc.live.read(run_id) as snap:
            try:
                found = q.record(snap.cur, snap.run, record_key=record_key, limit=limit,
                                 cursor=cursor, index=svc.live.lookup)
            except NotFound:
                # A train record the run never consumed is an answer, not a missing resource:
                # the report's evidence names such records (a skipped epoch's, a lost host's).
                if snap.uni.n is None or record_key >= snap.uni.n:
                    raise
                return _json({"record_keys": [record_key], "exposures": 0,
                              "exposures_by_epoch": {}, "segments_total": 0, "segments": [],
                              "next_cursor": None, "never_consumed": True})
        return _json(found, _next_page_link(request, found["next_cursor"]))

    @app.get("/v1/runs/{run_id}/records", tags=["records"],
             responses={**ERRORS, 200: NEXT_PAGE}, response_model=models.RecordLookup)
    def run_record_by_hash(
            request: Request, run_id: RunId,
            content_hash: Annotated[str, Query(pattern=r"^(0x[0-9a-fA-F]{1,16}|[0-9]{1,20})$",
                                               description="xxh3_64, decimal or 0x-hex")],
            limit: RecordLimit = 1000, cursor: RecordCursor = None) -> Response:
        """Every consumption of the records with this content hash; a page of `limit` at a
        time."""
        h = int(content_hash, 0) if content_hash.startswith("0x") else int(content_hash)
        with svc.live.read(run_id) as snap:
            if h >= 2**64:  # a well-formed number, but no xxh3_64 value: no record has it
                raise NotFound(f"no record has content hash {content_hash} (xxh3_64 values "
                                 "are below 2**64)")
            found = q.record(snap.cur, snap.run, content_hash=h, limit=limit, cursor=cursor,
                             index=svc.live.lookup)
        return _json(found, _next_page_link(request, found["next_cursor"]))

    @app.get("/v1/runs/{run_id}/domains", tags=["coverage"], responses=ERRORS,
             response_model=list[models.DomainShare])
    def run_domains(run_id: RunId) -> Response:
        """Per domain (from the manifest): planned vs actual share of exposures, coverage."""
        if svc.manifest is None:
            raise Unavailable("per-domain exposure needs the manifest: start the service "
                              "with --manifest")
        return _json(q.domains(svc.live.record_exposures(run_id), svc.manifest))

    @app.get("/v1/runs/{run_id}/metrics", tags=["metrics"], responses=ERRORS,
             response_model=models.Metrics)
    def run_metrics(run_id: RunId, points: Points = 500) -> Response:
        """Milestones (held-out loss, per-domain perplexity) against train loss."""
        return svc.json(("metrics", run_id, points), run_id,
                        lambda snap: q.metrics(snap.cur, snap.run, points))

    @app.get("/v1/runs/{run_id}/report", tags=["runs"], responses=ERRORS,
             response_model=models.Report)
    def run_report(run_id: RunId) -> Response:
        """The latest reconcile report (report.json) of this run: under --reports, or the live
        one the service keeps current (with --manifest and --spool)."""
        return _json(svc.newest_report(run_id))

    @app.get("/v1/runs/{run_id}/loss", tags=["metrics"], responses=ERRORS,
             response_model=models.LossAnswer)
    def run_loss(run_id: RunId) -> Response:
        """Training loss split by exposure: per window of steps, the mean loss of due
        exposures and of repeated ones (beyond what a perfect loader allows), the held-out
        loss at the milestones, and the test of whether repeats flattered the loss; from the
        newest reconcile report of the run (per-segment losses in the spool)."""
        rep = svc.newest_report(run_id)
        return _json({"as_of_step": (rep.get("consumption") or {}).get("last_step"),
                      "generated_at": rep.get("generated_at"), **(rep.get("loss") or {})})

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

    return app


def _json(value: Any, headers: dict[str, str] | None = None) -> Response:
    """An answer as it was computed: encoded once, never filtered through its model."""
    return Response(_encode(value), media_type="application/json", headers=headers)
