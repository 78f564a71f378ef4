"""One error shape for every error the API answers (401, 403, 404, 409, 422, 503, and the
routing errors): `{"status", "title", "detail", "errors"}`, the members of RFC 9457's problem
details that apply here. `detail` is always one sentence a person can act on; `errors` lists
the parameters at fault (422 only)."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from audit.core.errors import NotFound, Unavailable


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
    422: "a parameter or the body is not valid",
    503: "the work ran out of its time box",
}


def responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries for these error codes, all of the Problem shape."""
    return {c: {"model": Problem, "description": WHY[c]} for c in codes}


def problem(status: int, detail: str, errors: list[dict[str, Any]] | None = None,
            headers: dict[str, str] | None = None) -> JSONResponse:
    body = Problem(status=status, title=HTTPStatus(status).phrase, detail=detail,
                   errors=errors)
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _field_errors(exc: RequestValidationError) -> list[dict[str, Any]]:
    return [{"loc": [p if isinstance(p, int) else str(p) for p in e.get("loc", ())],
             "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))}
            for e in exc.errors()]


def install(app: FastAPI) -> None:
    """Answer the project's errors, request validation and routing errors in one shape."""

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
