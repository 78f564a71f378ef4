"""The pre-flight check over HTTP: POST runs it against the ledger this service owns and
records the verdict there; GET lists the verdicts recorded for a run. A trainer that resumes on
another topology while `tally serve` holds the ledger asks here (trainer/launch.py).

No `from __future__ import annotations` here: FastAPI must see the run-id type passed in as a
real annotation, not as a string naming a local variable."""


from typing import Any, Literal

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from audit.core.errors import NotFound, TallyError, Unavailable
from audit.preflight import record_verdict, run_preflight


class PreflightRequest(BaseModel):
    checkpoint: str = Field(min_length=1, max_length=4096,
                            description="checkpoint directory (latest step) or one step's "
                                        "directory, as the service's host sees it")
    hosts: int = Field(ge=1, le=65536, description="the new host count")
    global_batch: int | None = Field(None, ge=1, le=2**31 - 1,
                                     description="the new global batch (default: unchanged)")
    horizon: int | None = Field(None, ge=1, le=1_000_000,
                                description="steps to plan (default: to the epoch's end, "
                                            "at most 1000)")
    forced: bool = Field(False, description="the caller resumes even if the verdict is not "
                                            "safe (recorded with the verdict)")
    requested_by: Literal["api", "trainer"] = "api"


def add_routes(app: FastAPI, svc: Any, run_id_type: Any, errors: dict) -> None:
    @app.post("/v1/runs/{run_id}/preflight", tags=["preflight"],
              responses={**errors,
                         404: {"description": "unknown run, or no checkpoint at that path"},
                         422: {"description": "bad request or unusable checkpoint"}})
    def preflight(run_id: run_id_type, body: PreflightRequest) -> dict[str, Any]:
        """Run the pre-flight check for resuming `run_id` from a checkpoint on `hosts` hosts;
        the verdict (safe, unsafe or unknown, with findings) is recorded in the ledger."""
        if svc.manifest is None:
            raise Unavailable("the pre-flight check needs the manifest: start the service "
                                "with --manifest")
        with svc.live.read(run_id):  # 404 for an unknown run
            pass
        try:
            verdict = run_preflight(svc.ledger, run_id, svc.manifest.path, body.checkpoint,
                                    body.hosts, global_batch=body.global_batch,
                                    horizon=body.horizon, workers=1)
        except NotFound:
            raise  # 404: no checkpoint there
        except TallyError as exc:
            return JSONResponse({"detail": str(exc)}, status_code=422)
        vid = record_verdict(svc.ledger, verdict, forced=body.forced and not verdict.ok,
                             requested_by=body.requested_by)
        return {"id": vid, "exit_code": verdict.exit_code, **verdict.to_dict()}

    @app.get("/v1/runs/{run_id}/preflight", tags=["preflight"], responses=errors)
    def preflight_history(run_id: run_id_type) -> list[dict[str, Any]]:
        """Every pre-flight verdict recorded for this run, newest first."""
        with svc.live.read(run_id) as snap:
            rows = snap.cur.execute(
                "SELECT id, checked_at, checkpoint_step, old_hosts, new_hosts, status, forced, "
                "requested_by, headline FROM preflight_verdicts WHERE run_id = ? "
                "ORDER BY id DESC", [run_id]).fetchall()
        keys = ("id", "checked_at", "checkpoint_step", "old_hosts", "new_hosts", "status",
                "forced", "requested_by", "headline")
        return [{**dict(zip(keys, r, strict=True)), "checked_at": r[1].isoformat()}
                for r in rows]
