"""Post-hoc audits over HTTP, from the ledger this service owns (tally.audit.posthoc.answers): two
runs side by side (GET /v1/diff, cached per ledger version), and which records matching a list
of posted content hashes a run consumed (POST /v1/runs/{run}/exposure, at most
tally.audit.posthoc.answers.MAX_HASHES hashes a request).

No `from __future__ import annotations` here: FastAPI must see the types passed in as real
annotations, not as strings naming local variables."""


from typing import Annotated, Any

import numpy as np
from fastapi import FastAPI, Query
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from tally.api import errors as problems
from tally.api import models
from tally.audit.core.errors import Unavailable
from tally.audit.core.schema import RUN_ID_PATTERN
from tally.audit.ledger import queries as q
from tally.audit.posthoc import answers
from tally.audit.posthoc.exposure import ManifestHashes

HASH_PATTERN = r"^(0x[0-9a-fA-F]{1,16}|[0-9]{1,20})$"
DiffRun = Annotated[str, Query(pattern=RUN_ID_PATTERN, description="run id")]
Window = Annotated[int | None, Query(ge=1, le=2**62, description="steps per window (default: "
                                                              "about 20 windows)")]


class ExposureRequest(BaseModel):
    content_hashes: list[Annotated[str, Field(pattern=HASH_PATTERN)]] = Field(
        min_length=1, max_length=answers.MAX_HASHES,
        description="documents' content hashes (xxh3_64 of their token ids as little-endian "
                    "int32), decimal or 0x-hex strings")


def add_routes(app: FastAPI, svc: Any, run_id_type: Any, points_type: Any,
               errors: dict) -> None:
    @app.get("/v1/diff", tags=["runs"], responses=errors, response_model=models.Diff)
    def runs_diff(a: DiffRun, b: DiffRun, points: points_type = 500,
                  window: Window = None) -> Response:
        """Two runs of this ledger side by side, as `tally diff` compares them: identical
        steps, the first divergent step, per-step Jaccard similarity, records seen by one run
        only or more often, the histogram of exposure differences, both coverage curves."""
        with svc.live.read(a) as snap:  # 404 for an unknown run
            run_a, run_b = snap.run, q.run_of(snap.cur, b)

        def compute(snap: Any) -> bytes:
            states = {"a": snap.state[run_a], "b": snap.state[run_b]}
            d = answers.diff(snap.cur, {"a": run_a, "b": run_b}, {"a": a, "b": b}, states,
                             snap.uni, svc.manifest, points, window)
            return JSONResponse(jsonable_encoder(d)).body

        body = svc.live.answer(("diff", a, b, points, window), a, compute,
                               locked=svc.live.record_states((run_a, run_b)))
        return Response(body, media_type="application/json")

    @app.post("/v1/runs/{run_id}/exposure", tags=["records"],
              responses={**errors, **problems.responses(413)},
              response_model=models.ExposureAnswer)
    def run_exposure(run_id: run_id_type, body: ExposureRequest) -> Any:
        """Which of these documents did the run consume? Each content hash matched to every
        manifest record with it (exact duplicates included), with the run's exposures of
        them: how often, first and last step, hosts, epochs."""
        if svc.manifest is None:
            raise Unavailable("matching documents to records needs the manifest: start the "
                              "service with --manifest")
        index = ManifestHashes.load(svc.manifest.path)
        values = [int(h, 0) if h[:2].lower() == "0x" else int(h) for h in body.content_hashes]
        # A well-formed number at or above 2**64 is no xxh3_64 value: it matches no record.
        known = np.array([v < 2**64 for v in values], bool)
        hashes = np.array([v if v < 2**64 else 0 for v in values], np.uint64)
        with svc.live.read(run_id) as snap:
            out = answers.exposure(snap.cur, snap.run, run_id, hashes, known, index)
        for res, text, ok in zip(out["results"], body.content_hashes, known, strict=True):
            if not ok:  # a number beyond 64 bits, which no record has: echoed as given
                res["content_hash"] = text
        return JSONResponse(jsonable_encoder(out))
