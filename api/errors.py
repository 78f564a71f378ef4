"""One error shape for every error the API answers (401, 403, 404, 409, 413, 422, 503, the
routing errors, and a 500 for any exception nothing else answered): RFC 9457's problem details,
as application/problem+json. `type` is always `about:blank` (each status has one meaning in this
API, listed in the schema, and `title` is its phrase, as RFC 9457 asks of that type); `instance`
is the path of the request that failed; `detail` is one sentence a person can act on; `errors`,
on a 422 only, lists the parameters at fault."""

from __future__ import annotations

import logging
from contextvars import ContextVar
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tally.audit.core.errors import NotFound, Unavailable

log = logging.getLogger("tally.api")
MEDIA_TYPE = "application/problem+json"


class FieldError(BaseModel):
    model_config = ConfigDict(extra="forbid")

    loc: list[str | int] = Field(description="where: the part of the request, then the name",
                                 examples=[["query", "step"]])
    msg: str = Field(examples=["Input should be greater than or equal to 0"])
    type: str = Field(examples=["greater_than_equal"])


class Problem(BaseModel):
    """An error answer (RFC 9457 problem details)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"type": "about:blank", "status": 404, "title": "Not Found",
         "detail": "unknown run 'exp9': no segment of it has been ingested",
         "instance": "/v1/runs/exp9"}]})

    type: str = Field("about:blank", description="the problem type: `about:blank`, the "
                                                 "status alone says what went wrong")
    status: int = Field(description="the HTTP status code, repeated")
    title: str = Field(description="the status code's phrase")
    detail: str = Field(description="what is wrong, in one sentence")
    instance: str | None = Field(None, description="the path of the request that failed")
    errors: list[FieldError] | None = Field(
        None, description="the request's parameters at fault (422 only; absent otherwise)")


WHY = {
    401: "missing or wrong bearer token (the service was started with --token)",
    403: "the checkpoint lies outside the checkpoint directories this service may read",
    404: "unknown run, host, record or report",
    409: "needs something the service was not started with (a manifest, a reports directory)",
    413: "the request body is larger than the service reads (tally.api.app.MAX_BODY_BYTES)",
    422: "a parameter or the body is not valid",
    503: "the work ran out of its time box",
}
# Each status's own example in the schema (one Problem example showed a 404 body under 409
# and 422 too).
_EXAMPLES: dict[int, tuple[str, str, list[dict[str, Any]] | None]] = {
    401: ("/v1/runs", "missing or wrong bearer token", None),
    403: ("/v1/runs/exp1/preflight", "the checkpoint lies outside the checkpoint directories "
          "this service may read (the run's recorded checkpoint directory, or --checkpoints "
          "DIR)", None),
    404: ("/v1/runs/exp9", "unknown run 'exp9': no segment of it has been ingested", None),
    409: ("/v1/runs/exp1/domains", "per-domain exposure needs the manifest: start the service "
          "with --manifest", None),
    413: ("/v1/runs/exp1/exposure", "the request body is larger than 1,048,576 bytes, the most "
          "this service reads", None),
    422: ("/v1/runs/exp1/coverage", "invalid request: query step: Input should be greater "
          "than or equal to 0",
          [{"loc": ["query", "step"], "msg": "Input should be greater than or equal to 0",
            "type": "greater_than_equal"}]),
    503: ("/v1/runs/exp1/preflight", "the pre-flight check ran past its time box of 120 s and "
          "was stopped; give a shorter horizon", None),
}
# The path of the request being answered, for `instance`: set by the outermost middleware
# (Unhandled), so every problem made while answering it names it, wherever it is made.
_instance: ContextVar[str | None] = ContextVar("tally_problem_instance", default=None)


def example(status: int) -> dict[str, Any]:
    """The schema's example answer of this error status."""
    path, detail, errors = _EXAMPLES[status]
    return _body(status, detail, errors, path)


def response(status: int) -> dict[str, Any]:
    """The OpenAPI response object of an error status, as it appears in the schema: the
    Problem shape with this status's own example, as application/problem+json (RFC 9457) and
    as application/json, for clients that look for that."""
    media = {"schema": {"$ref": "#/components/schemas/Problem"}, "example": example(status)}
    return {"description": WHY[status], "content": {MEDIA_TYPE: media, "application/json":
                                                    dict(media)}}


def responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """FastAPI `responses` entries for these error codes (`response`, with the model, so that
    the Problem schema is in the components)."""
    return {c: {"model": Problem, **response(c)} for c in codes}


def _body(status: int, detail: str, errors: list[dict[str, Any]] | None,
          instance: str | None) -> dict[str, Any]:
    # exclude_none: `errors` (and `instance` outside a request) are left out, never null.
    return Problem(status=status, title=HTTPStatus(status).phrase, detail=detail,
                   instance=instance, errors=errors).model_dump(exclude_none=True)


def problem(status: int, detail: str, errors: list[dict[str, Any]] | None = None,
            headers: dict[str, str] | None = None) -> JSONResponse:
    """The answer of an error, naming the request being answered as its `instance`."""
    return JSONResponse(_body(status, detail, errors, _instance.get()), status_code=status,
                        headers=headers, media_type=MEDIA_TYPE)


def invalid(where: str, name: str, msg: str, kind: str) -> RequestValidationError:
    """A 422 for a parameter the route itself finds wrong (FastAPI's validation found it
    valid on its own), in the shape of FastAPI's own: raise it."""
    return RequestValidationError([{"loc": (where, name), "msg": msg, "type": kind}])


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
        _instance.set(scope["path"])
        watched = WatchedSend(send)
        try:
            await self.app(scope, receive, watched)
        except Exception:
            log.exception("unhandled error answering %s %s", scope["method"], scope["path"])
            if not watched.started:  # else the server closes the connection of the answer begun
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


class WatchedSend:
    """An ASGI `send` that remembers whether the answer has begun: until then a middleware may
    still answer with a problem instead (the catch-all's 500, the body limit's 413)."""

    def __init__(self, send: Send) -> None:
        self.send, self.started = send, False

    async def __call__(self, message: Message) -> None:
        self.started = self.started or message["type"] == "http.response.start"
        await self.send(message)
