"""The run routes of the live API: the runs in the ledger and, per run, its summary, coverage,
step and host series, record lookups, domains, metrics, loss, its newest reconcile report and
that report's page; each answer cached per ledger version by the live ledger
(tally.audit.ledger.live) and computed by tally.audit.ledger.queries. Pages of an answer are
named by an opaque cursor in the Link header (RFC 8288)."""

from __future__ import annotations

import base64
from typing import Annotated, Any

from fastapi import FastAPI, Query, Request
from fastapi import Path as PathParam
from fastapi.responses import HTMLResponse, Response

from tally.api import errors, models
from tally.api.service import Service, answer, encode
from tally.audit.core.errors import NotFound, Unavailable
from tally.audit.core.schema import MAX_STEP, RUN_ID_PATTERN
from tally.audit.ledger import queries as q
from tally.audit.reconcile.html import served
from tally.audit.render import vocabulary

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
    return encode(found), None if nxt is None else (nxt, found["bucket"])


def _paged(limit: int, cursor: int | None) -> tuple[int | None, ...]:
    """A step series' page in its cache key: nothing for the first page of the default size
    (the key the answer had before pages)."""
    return () if (limit, cursor) == (q.MAX_POINTS, None) else (limit, cursor)


def _step_link(request: Request, nxt: tuple[int, int] | None) -> dict[str, str]:
    # The bucket size is pinned in the next page's URL: with `points` alone it follows the
    # run's last step, which moves while the run is ingested, and pages would not align.
    return {} if nxt is None else _next_page_link(request, str(nxt[0]), bucket=nxt[1])


def add_routes(app: FastAPI, svc: Service) -> None:
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
            page, request.query_params.get("token") if svc.settings.token is not None else None)))

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
        return answer(page, _next_page_link(request, _run_cursor(page[-1]["run_id"])
                                           if len(found) > limit else None))

    @app.get("/v1/runs/{run_id}", tags=["runs"], responses=ERRORS,
             response_model=models.RunSummary)
    def run_summary(run_id: RunId) -> Response:
        """Coverage, duplicates, hosts, restarts and the alert status of one run."""
        return answer(svc.summary(run_id))

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
                return answer({"record_keys": [record_key], "exposures": 0,
                              "exposures_by_epoch": {}, "segments_total": 0, "segments": [],
                              "next_cursor": None, "never_consumed": True})
        return answer(found, _next_page_link(request, found["next_cursor"]))

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
        return answer(found, _next_page_link(request, found["next_cursor"]))

    @app.get("/v1/runs/{run_id}/domains", tags=["coverage"], responses=ERRORS,
             response_model=list[models.DomainShare])
    def run_domains(run_id: RunId) -> Response:
        """Per domain (from the manifest): planned vs actual share of exposures, coverage."""
        if svc.manifest is None:
            raise Unavailable("per-domain exposure needs the manifest: start the service "
                              "with --manifest")
        return answer(q.domains(svc.live.record_exposures(run_id), svc.manifest))

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
        return answer(svc.newest_report(run_id))

    @app.get("/v1/runs/{run_id}/loss", tags=["metrics"], responses=ERRORS,
             response_model=models.LossAnswer)
    def run_loss(run_id: RunId) -> Response:
        """Training loss split by exposure: per window of steps, the mean loss of due
        exposures and of repeated ones (beyond what a perfect loader allows), the held-out
        loss at the milestones, and the test of whether repeats flattered the loss; from the
        newest reconcile report of the run (per-segment losses in the spool)."""
        rep = svc.newest_report(run_id)
        return answer({"as_of_step": (rep.get("consumption") or {}).get("last_step"),
                      "generated_at": rep.get("generated_at"), **(rep.get("loss") or {})})
