"""/docs (Swagger UI) and /redoc (ReDoc), served from files the fastapi-offline package ships:
FastAPI's own pages load them from a CDN and are blank on an air-gapped cluster. Also the
schema's bearer scheme (Swagger UI's "Authorize"), meaningful operation ids, and /favicon.ico.

Why that package: swagger-ui-bundle (1.1.0, its newest) ships Swagger UI 4.15, which refuses
FastAPI's OpenAPI 3.1 schema ("Unable to render this definition"); fastapi-offline ships
Swagger UI 5 and ReDoc 2, and depends on FastAPI only. ReDoc's sidebar shows Redocly's logo
from a CDN: the ReDoc script is served with that address replaced (`redoc_script`), and a
Content-Security-Policy keeps the pages on this service whatever else a script asks for.

With --token the pages, their files and /openapi.json answer without one (`OPEN`): the schema
is the same for every Tally and holds no data; every operation it lists needs the token."""

from __future__ import annotations

import functools
import re
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse, Response
from fastapi.routing import APIRoute
from fastapi.staticfiles import StaticFiles

from tally.api import errors

STATIC = "/docs-static"
REDOC_JS = f"{STATIC}/redoc.offline.js"
CSP = ("default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' "
       "'unsafe-inline'; img-src 'self' data:; font-src 'self' data:; worker-src 'self' blob:; "
       "connect-src 'self'")
# What answers without the token: the documentation pages, their files, the schema, the icon.
OPEN = re.compile(rf"/docs|/redoc|/openapi\.json|/favicon\.ico|{STATIC}/[^/]+")
REDOC_LOGO = "https://cdn.redoc.ly/redoc/logo-mini.svg"
SCHEME = "bearer"


def _files() -> Any:
    return resources.files("fastapi_offline") / "static"


@functools.cache
def redoc_script() -> bytes:
    """ReDoc's script with its logo's CDN address replaced by an empty image (`data:,`): the
    image fails to load at once and ReDoc removes it, and nothing is asked of another host."""
    text = (_files() / "redoc.standalone.js").read_text(encoding="utf-8")
    if REDOC_LOGO not in text:  # another ReDoc: the test that scans the page says what it has
        return text.encode()
    return text.replace(REDOC_LOGO, "data:,").encode()


def operation_id(route: APIRoute) -> str:
    """An operation's id: its handler's name in camelCase (`list_runs` -> `listRuns`), where
    FastAPI's own would be `list_runs_v1_runs_get`."""
    first, *rest = route.name.split("_")
    return first + "".join(w.capitalize() for w in rest)


def secure(app: FastAPI) -> None:
    """Declare the bearer scheme in the schema (Swagger UI then shows "Authorize") and that
    every operation needs it, with its 401: call when the service is started with a token."""
    make = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = make()
        schema.setdefault("components", {}).setdefault("securitySchemes", {})[SCHEME] = {
            "type": "http", "scheme": "bearer",
            "description": "the token the service was started with (--token, or "
                           "$TALLY_API_TOKEN)"}
        for ops in schema.get("paths", {}).values():
            for op in ops.values():
                op["security"] = [{SCHEME: []}]
                op.setdefault("responses", {}).setdefault("401", errors.response(401))
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def install(app: FastAPI) -> None:
    """Serve /docs, /redoc and /favicon.ico offline (the app is made with docs_url=None,
    redoc_url=None)."""
    files = _files()

    def page(html: HTMLResponse) -> HTMLResponse:
        html.headers["Content-Security-Policy"] = CSP
        return html

    # Before the mount: a route of the mount's prefix would never be reached after it.
    @app.get(REDOC_JS, include_in_schema=False)
    def redoc_js() -> Response:
        return Response(redoc_script(), media_type="text/javascript",
                        headers={"Cache-Control": "max-age=86400"})

    app.mount(STATIC, StaticFiles(directory=str(files)), name="docs-static")

    @app.get("/favicon.ico", include_in_schema=False)
    def favicon() -> FileResponse:
        return FileResponse(str(files / "favicon.png"), media_type="image/png",
                            headers={"Cache-Control": "max-age=86400"})

    @app.get("/docs", include_in_schema=False)
    def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return page(get_swagger_ui_html(
            openapi_url=f"{root}{app.openapi_url}", title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{root}{STATIC}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{STATIC}/swagger-ui.css",
            swagger_favicon_url=f"{root}/favicon.ico",
            # No badge that asks swagger.io to validate the schema.
            swagger_ui_parameters={"validatorUrl": None}))

    @app.get("/redoc", include_in_schema=False)
    def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return page(get_redoc_html(
            openapi_url=f"{root}{app.openapi_url}", title=f"{app.title} - ReDoc",
            redoc_js_url=f"{root}{REDOC_JS}", redoc_favicon_url=f"{root}/favicon.ico",
            with_google_fonts=False))
