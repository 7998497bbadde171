"""The OpenAPI schema (``/openapi.json``) and Swagger UI (``/docs``), behind a viewer token like every route.

The schema is a map of the ops surface, and "no route without authentication but /health"
is the rule. Tools that read it send the header (``curl -H 'Authorization: Bearer …'``,
schemathesis ``-H``).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse

from serving.admin.deps import Viewer

router = APIRouter()


@router.get("/openapi.json", include_in_schema=False, name="openapi")
def openapi(viewer: Viewer, request: Request) -> JSONResponse:
    """The OpenAPI schema (a viewer token is needed: no route is public but /health)."""
    return JSONResponse(request.app.openapi())


@router.get("/docs", include_in_schema=False, name="docs")
def docs(viewer: Viewer, request: Request) -> HTMLResponse:
    """Swagger UI over /openapi.json."""
    return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{request.app.title} - docs")
