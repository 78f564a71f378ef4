"""/docs (Swagger UI) and /redoc (ReDoc), served from files the fastapi-offline package ships:
FastAPI's own pages load them from a CDN and are blank on an air-gapped cluster.

Why that package: swagger-ui-bundle (1.1.0, its newest) ships Swagger UI 4.15, which refuses
FastAPI's OpenAPI 3.1 schema ("Unable to render this definition"); fastapi-offline ships
Swagger UI 5 and ReDoc 2, and depends on FastAPI only. A Content-Security-Policy keeps the
pages on this service: ReDoc's sidebar asks a CDN for Redocly's logo, which the policy blocks
before any request leaves (the image then removes itself)."""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

STATIC = "/docs-static"
CSP = ("default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' "
       "'unsafe-inline'; img-src 'self' data:; font-src 'self' data:; worker-src 'self' blob:; "
       "connect-src 'self'")


def install(app: FastAPI) -> None:
    """Serve /docs and /redoc offline (the app is made with docs_url=None, redoc_url=None)."""
    files = resources.files("fastapi_offline") / "static"
    app.mount(STATIC, StaticFiles(directory=str(files)), name="docs-static")

    def page(html: HTMLResponse) -> HTMLResponse:
        html.headers["Content-Security-Policy"] = CSP
        return html

    @app.get("/docs", include_in_schema=False)
    def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return page(get_swagger_ui_html(
            openapi_url=f"{root}{app.openapi_url}", title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{root}{STATIC}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{STATIC}/swagger-ui.css",
            swagger_favicon_url=f"{root}{STATIC}/favicon.png",
            # No badge that asks swagger.io to validate the schema.
            swagger_ui_parameters={"validatorUrl": None}))

    @app.get("/redoc", include_in_schema=False)
    def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return page(get_redoc_html(
            openapi_url=f"{root}{app.openapi_url}", title=f"{app.title} - ReDoc",
            redoc_js_url=f"{root}{STATIC}/redoc.standalone.js",
            redoc_favicon_url=f"{root}{STATIC}/favicon.png", with_google_fonts=False))
