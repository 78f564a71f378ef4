"""One error shape for every error the API answers (401, 403, 404, 409, 413, 422, 503, the
routing errors, and a 500 for any exception nothing else answered): `{"status", "title",
"detail", "errors"}`, the members of RFC 9457's problem details that apply here, as
application/problem+json. `detail` is always one sentence a person can act on; `errors` lists
the parameters at fault (422 only)."""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from audit.core.errors import NotFound, Unavailable

log = logging.getLogger("tally.api")
MEDIA_TYPE = "application/problem+json"


class FieldError(BaseModel):
    model_config = ConfigDict(extra="forbid")

    loc: list[str | int] = Field(description="where: the part of the request, then the name",
                                 examples=[["query", "step"]])
    msg: str = Field(examples=["Input should be greater than or equal to 0"])
    type: str = Field(examples=["greater_than_equal"])


class Problem(BaseModel):
    """An error answer."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"status": 404, "title": "Not Found",
         "detail": "unknown run 'exp9': no segment of it has been ingested", "errors": None}]})

    status: int = Field(description="the HTTP status code, repeated")
    title: str = Field(description="the status code's phrase")
    detail: str = Field(description="what is wrong, in one sentence")
    errors: list[FieldError] | None = Field(
        None, description="the request's parameters at fault (422 only)")


WHY = {
    401: "missing or wrong bearer token (the service was started with --token)",
    403: "the checkpoint lies outside the checkpoint directories this service may read",
    404: "unknown run, host, record or report",
    409: "needs something the service was not started with (a manifest, a reports directory)",
    413: "the request body is larger than the service reads (api.app.MAX_BODY_BYTES)",
    422: "a parameter or the body is not valid",
    503: "the work ran out of its time box",
}


def responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries for these error codes, all of the Problem shape (served as
    application/problem+json, RFC 9457; listed as application/json too, for clients that
    look for that)."""
    ref = {"schema": {"$ref": "#/components/schemas/Problem"}}
    return {c: {"model": Problem, "description": WHY[c], "content": {MEDIA_TYPE: ref}}
            for c in codes}


def problem(status: int, detail: str, errors: list[dict[str, Any]] | None = None,
            headers: dict[str, str] | None = None) -> JSONResponse:
    body = Problem(status=status, title=HTTPStatus(status).phrase, detail=detail,
                   errors=errors)
    return JSONResponse(body.model_dump(), status_code=status, headers=headers,
                        media_type=MEDIA_TYPE)


def _field_errors(exc: RequestValidationError) -> list[dict[str, Any]]:
    return [{"loc": [p if isinstance(p, int) else str(p) for p in e.get("loc", ())],
             "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))}
            for e in exc.errors()]


class Unhandled:
    """Any exception no handler answered: a 500 in the problem shape (Starlette's own is plain
    text), logged here with its traceback and not raised on (the server would log it again).
    Outermost of the app's middleware, so that theirs are covered too."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception:
            log.exception("unhandled error answering %s %s", scope["method"], scope["path"])
            if not started:  # else the server closes the connection of the answer begun
                await problem(500, "the service failed to answer this request: an internal "
                                   "error, logged with its traceback by the service")(
                    scope, receive, send)


def install(app: FastAPI) -> None:
    """Answer the project's errors, request validation and routing errors in one shape, and
    any other exception as a 500 of that shape (`Unhandled`: call this after adding every
    other middleware)."""
    app.add_middleware(Unhandled)

    @app.exception_handler(NotFound)
    async def not_found(request: Request, exc: NotFound) -> JSONResponse:
        return problem(404, str(exc))

    @app.exception_handler(Unavailable)
    async def unavailable(request: Request, exc: Unavailable) -> JSONResponse:
        return problem(409, str(exc))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = _field_errors(exc)
        said = "; ".join(f"{' '.join(map(str, e['loc']))}: {e['msg']}" for e in errors[:3])
        more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
        return problem(422, f"invalid request: {said}{more}", errors)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return problem(exc.status_code, str(exc.detail), headers=exc.headers)
