"""The pre-flight check over HTTP: POST runs it against the ledger this service owns and
records the verdict there; GET lists the verdicts recorded for a run. A trainer that resumes on
another topology while `tally serve` holds the ledger asks here (trainer/launch.py).

What a client may make the service do is bounded: the checkpoint must lie under a checkpoint
directory the service may read (`--checkpoints DIR`, else the directories the run's trainer
recorded in its spool files), error messages never echo the file system, the horizon is capped,
and the shadow run is cancelled when the client goes away or its time box is spent.

No `from __future__ import annotations` here: FastAPI must see the run-id type passed in as a
real annotation, not as a string naming a local variable."""

import asyncio
import os
import threading
import time
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from tally.api import errors, models
from tally.audit.core.errors import NotFound, TallyError, Unavailable
from tally.audit.ledger import queries as q

MAX_HORIZON = 2000  # steps per request: ~2 s per host on one core (bench/RESULTS.md)


class PreflightRequest(BaseModel):
    checkpoint: str = Field(min_length=1, max_length=4096,
                            description="checkpoint directory (latest step) or one step's "
                                        "directory, as the service's host sees it; it must lie "
                                        "under a checkpoint directory the service may read")
    hosts: int = Field(ge=1, le=65536, description="the new host count")
    global_batch: int | None = Field(None, ge=1, le=2**31 - 1,
                                     description="the new global batch (default: unchanged)")
    horizon: int | None = Field(None, ge=1, le=MAX_HORIZON,
                                description="steps to plan (default: to the epoch's end, "
                                            "at most 1000)")
    forced: bool = Field(False, description="the caller resumes even if the verdict is not "
                                            "safe (recorded with the verdict)")
    requested_by: Literal["api", "trainer"] = "api"


class Forbidden(TallyError):
    """A checkpoint outside the directories the service may read (HTTP 403)."""


def checkpoint_roots(svc: Any, run: int, cur: Any) -> list[str]:
    """The directories checkpoints may be read from: --checkpoints, else the run's own."""
    if svc.settings.checkpoints:
        return [os.path.realpath(p) for p in svc.settings.checkpoints]
    return [os.path.realpath(r[0]) for r in cur.execute(
        "SELECT DISTINCT checkpoint_dir FROM attempts WHERE run = ? AND checkpoint_dir "
        "IS NOT NULL", [run]).fetchall()]


def _inside(path: str, roots: list[str]) -> bool:
    real = os.path.realpath(path)
    return any(os.path.commonpath([real, root]) == root for root in roots)


def add_routes(app: FastAPI, svc: Any, run_id_type: Any, responses: dict) -> None:
    cursor_type = Annotated[int | None, Query(ge=1, le=2**31 - 1, description="the verdicts "
                                              "older than this id (the previous page's Link "
                                              "header, rel=next, names it)")]

    @app.post("/v1/runs/{run_id}/preflight", tags=["preflight"],
              response_model=models.PreflightAnswer,
              responses={**responses, **errors.responses(403, 413, 503),
                         404: {**responses[404],
                               "description": "unknown run, or no checkpoint at that path"},
                         422: {**responses[422],
                               "description": "bad request or unusable checkpoint"}})
    async def check_preflight(run_id: run_id_type, body: PreflightRequest,
                        request: Request) -> Any:
        """Run the pre-flight check for resuming `run_id` from a checkpoint on `hosts` hosts;
        the verdict (safe, unsafe or unknown, with findings) is recorded in the ledger."""
        if svc.manifest is None:
            raise Unavailable("the pre-flight check needs the manifest: start the service "
                              "with --manifest")
        try:  # the loader's packages: a service installed with the api extra alone has none
            from tally.pipeline.shadow import Cancelled
        except ModuleNotFoundError as exc:
            raise Unavailable(f"the pre-flight check needs the train extra ({exc.name} is not "
                              "installed): pip install 'tally-audit[train]'") from None
        with svc.live.read(run_id) as snap:  # 404 for an unknown run
            roots = checkpoint_roots(svc, snap.run, snap.cur)
        if not roots:
            raise Forbidden("no checkpoint directory is known for this run: its trainer did "
                            "not record one, and the service was started without "
                            "--checkpoints DIR")
        if not _inside(body.checkpoint, roots):
            raise Forbidden("the checkpoint lies outside the checkpoint directories this "
                            "service may read (the run's recorded checkpoint directory, or "
                            "--checkpoints DIR)")
        cancel = threading.Event()
        work = asyncio.ensure_future(asyncio.to_thread(_check, svc, run_id, body, cancel))
        deadline = time.monotonic() + svc.settings.preflight_seconds
        try:
            while not work.done():
                await asyncio.wait({work}, timeout=0.25)
                if work.done():
                    break
                if await request.is_disconnected() or time.monotonic() > deadline:
                    cancel.set()
            result = await work
            return result if isinstance(result, Response) else JSONResponse(result)
        except Cancelled:
            return errors.problem(503, f"the pre-flight check ran past its time box of "
                                       f"{svc.settings.preflight_seconds:.0f} s and was "
                                       "stopped; give a shorter horizon")
        finally:
            cancel.set()

    @app.get("/v1/runs/{run_id}/preflight", tags=["preflight"],
             response_model=list[models.PreflightRecord],
             responses={**responses, 200: {"headers": {"Link": {
                 "description": '`<URL>; rel="next"` while more pages follow',
                 "schema": {"type": "string"}}}}})
    def list_preflight_verdicts(request: Request, run_id: run_id_type,
                          limit: Annotated[int, Query(ge=1, le=1000, description="verdicts "
                                                      "per page (default 100)")] = 100,
                          cursor: cursor_type = None) -> Response:
        """The pre-flight verdicts recorded for this run, newest first, a page of `limit` at
        a time (the Link header names the next page)."""
        with svc.live.read(run_id) as snap:
            rows = snap.cur.execute(
                f"SELECT id, checked_at{q.UTC}, checkpoint_step, old_hosts, new_hosts, status, "
                "forced, requested_by, headline FROM preflight_verdicts WHERE run_id = $run AND "
                "($before IS NULL OR id < $before) ORDER BY id DESC LIMIT $limit",
                {"run": run_id, "before": cursor, "limit": limit + 1}).fetchall()
        keys = ("id", "checked_at", "checkpoint_step", "old_hosts", "new_hosts", "status",
                "forced", "requested_by", "headline")
        page = [{**dict(zip(keys, r, strict=True)), "checked_at": q.utc_iso(r[1])}
                for r in rows[:limit]]
        headers = {}
        if len(rows) > limit:
            nxt = request.url.include_query_params(cursor=page[-1]["id"])
            headers["Link"] = f'<{nxt}>; rel="next"'
        return JSONResponse(page, headers=headers)

    @app.exception_handler(Forbidden)
    async def forbidden(request: Request, exc: Forbidden):
        return errors.problem(403, str(exc))


def _check(svc: Any, run_id: str, body: PreflightRequest,
           cancel: threading.Event) -> dict[str, Any]:
    """The check and its record (in a worker thread). Checkpoint errors are answered without
    the file system's own words: which paths exist, or what a directory holds, is not the
    client's to learn."""
    from tally.audit.preflight import load_checkpoint_meta, record_verdict, run_preflight
    from tally.pipeline.shadow import Cancelled

    try:
        meta = load_checkpoint_meta(Path(body.checkpoint))
    except NotFound:
        raise NotFound("no checkpoint at that path") from None
    except TallyError:
        return errors.problem(422, "the checkpoint cannot be read as a Tally checkpoint (not "
                                   "one, or damaged)")
    try:
        verdict = run_preflight(svc.ledger, run_id, svc.manifest.path, meta, body.hosts,
                                global_batch=body.global_batch, horizon=body.horizon,
                                workers=1, cancel=cancel)
    except Cancelled:
        raise
    except TallyError as exc:
        return errors.problem(422, str(exc))
    vid = record_verdict(svc.ledger, verdict, forced=body.forced and not verdict.ok,
                         requested_by=body.requested_by)
    return {"id": vid, "exit_code": verdict.exit_code, **verdict.to_dict()}
