"""The live API (FastAPI), assembled: the service (tally.api.service: the live ledger, which owns
the snapshots, the cached answers and the ingest loop, tally.audit.ledger.live), its settings
(tally.api.settings), the guards every request passes (the bearer token, the body limit), and
the routes, one module per family: run_routes, preflight_routes, posthoc_routes and
service_routes; the answers themselves are tally.audit.ledger.queries. One process owns the
ledger: a background thread ingests the spool while request handlers read, each request inside
one snapshot transaction (so an answer never sees half a segment file)."""

from __future__ import annotations

import hmac
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException

from tally.api import docs, errors
from tally.api.metrics import Exposition, RequestTimer
from tally.api.posthoc_routes import add_routes as add_posthoc_routes
from tally.api.preflight_routes import add_routes as add_preflight_routes
from tally.api.run_routes import ERRORS, Points, RunId
from tally.api.run_routes import add_routes as add_run_routes
from tally.api.service import FiniteJSONResponse, Service
from tally.api.service_routes import add_routes as add_service_routes
from tally.api.settings import ServeSettings
from tally.audit.ledger.database import Ledger

# What a browser opens by URL, so that a `?token=` opens it too: the pages, and the answers
# report.html's evidence links open (tally.audit.reconcile.html.served carries the page's token).
PAGES = re.compile(r"/|/runs/[^/]+/report\.html"
                   r"|/v1/runs/[^/]+/(steps|hosts/\d+/steps|records/\d+)")
# Request bodies: a pre-flight request is a few hundred bytes, an exposure request of
# MAX_HASHES hashes about 250 KB. A 1 GB body was read, parsed and answered 200 (+3 GB).
MAX_BODY_BYTES = 1 << 20


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



def create_app(ledger: Ledger, settings: ServeSettings | None = None, **fields: Any) -> FastAPI:
    """The app over an open, writable ledger, as `settings` say (with a spool, it ingests
    while it serves). `fields` instead of `settings`: those settings, the others at their
    defaults (`ServeSettings(**fields)`, checked as it is made: a TallyError saying which is
    wrong)."""
    if settings is None:
        settings = ServeSettings(**fields)
    elif fields:
        raise TypeError(f"create_app takes settings or their fields, not both: {sorted(fields)}")
    svc = Service(ledger, settings)
    app = FastAPI(title="Tally live API", version="1",
                  description="What a training run has consumed, while it runs: coverage and "
                              "duplication per step and per host, record lookups, alerts. "
                              "Every error answers in one shape (`Problem`).",
                  lifespan=svc.lifespan, default_response_class=FiniteJSONResponse,
                  docs_url=None, redoc_url=None,
                  generate_unique_id_function=docs.operation_id)
    app.state.service = svc
    docs.install(app)  # /docs and /redoc, offline
    scrape = Exposition(svc, hosts=settings.metrics_hosts)

    # Middleware added last runs first: errors' catch-all, the request timer, the body limit,
    # then the token.
    if settings.token is not None:
        app.add_middleware(BearerToken, token=settings.token)
        docs.secure(app)  # the bearer scheme, and 401, on every operation of the schema
    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES)
    app.add_middleware(RequestTimer, histogram=scrape.latency)
    errors.install(app)

    add_preflight_routes(app, svc, RunId, ERRORS)
    add_posthoc_routes(app, svc, RunId, Points, ERRORS)
    add_service_routes(app, svc, scrape)
    add_run_routes(app, svc)
    return app
