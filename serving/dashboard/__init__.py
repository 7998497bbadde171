"""The ops dashboard, served by the admin API: a static page and one data route.

:func:`install_dashboard` adds to an admin app (``serving.admin.app.create_app``):

- ``GET /v1/dashboard`` (viewer token): everything the page draws, in one answer
  (:func:`serving.dashboard.api.dashboard_data`);
- ``GET /dashboard``: the page itself, a static shell with no data in it (login form,
  panels, the script); served without a token, like ``/dashboard/static/...`` (its script,
  stylesheet and Plotly.js, taken from the installed ``plotly`` Python package so nothing
  is fetched from a CDN). Every piece of data the page shows comes from ``/v1/...`` with
  the ops token the user typed (kept in the tab's ``sessionStorage``, sent as
  ``Authorization: Bearer``). Promote and roll back call ``POST /v1/promote`` and
  ``POST /v1/rollback``, so the roles and the audit trail are the API's own; each answers
  202 with an operation, which the page reads (``GET /v1/operations/{id}``) until it ends.

The public paths are listed in :data:`PUBLIC_PATHS`; ``serving.admin.app.check_routes_protected``
must accept them (or run before :func:`install_dashboard`), and :func:`check_dashboard_routes`
checks that the data route kept its auth dependency. The dashboard takes its auth from
:mod:`serving.admin.deps`; the admin app imports this package, never the other way round.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import plotly
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import FileResponse, JSONResponse
from fastapi.routing import APIRoute
from starlette.staticfiles import StaticFiles

from serving.admin.deps import requires as role_dependency
from serving.admin.errors import ERROR_RESPONSES
from serving.dashboard.api import KafkaLagProbe, dashboard_data
from serving.dashboard.schemas import DashboardPublic

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from flywheel.core.settings import Settings

STATIC_DIR = Path(__file__).resolve().parent / "static"
"""The page's own files (index.html, app.js, style.css)."""
PAGE_PATH = "/dashboard"
STATIC_PATH = "/dashboard/static"
PLOTLY_PATH = f"{STATIC_PATH}/plotly.min.js"
DATA_PATH = "/v1/dashboard"
PUBLIC_PATHS = frozenset({PAGE_PATH, STATIC_PATH, PLOTLY_PATH})
"""Paths the dashboard serves without a token: the page shell and its static files (no data)."""
SECURITY_HEADERS = {
    # Plotly sets inline styles on the elements it draws; scripts and data come from this origin only.
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data: blob:; "
        "connect-src 'self'; font-src 'self' data:; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; "
        "form-action 'self'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}


def plotly_js_path() -> Path:
    """Plotly.js as shipped inside the installed ``plotly`` Python package (raises if it is missing)."""
    path = Path(plotly.__file__).resolve().parent / "package_data" / "plotly.min.js"
    if not path.is_file():
        raise RuntimeError(f"plotly.min.js not found at {path}: is the `plotly` package installed completely?")
    return path


def install_dashboard(
    app: FastAPI, settings: Settings, engine: Engine, requires: Callable[[str], Any] = role_dependency
) -> None:
    """Add the dashboard page, its static files and ``GET /v1/dashboard`` (viewer) to ``app``.

    ``requires`` maps a role to its FastAPI dependency (default: ``serving.admin.deps.requires``).
    Call it once per app; the Kafka lag probe it creates is kept in ``app.state.dashboard_kafka``.
    """
    plotly_js = plotly_js_path()
    probe = KafkaLagProbe(settings)
    app.state.dashboard_kafka = probe
    data = APIRouter(prefix="/v1", dependencies=[Depends(requires("viewer"))], responses=ERROR_RESPONSES)

    @data.get("/dashboard", name="dashboard.show", summary="Dashboard data", response_model=DashboardPublic)
    def dashboard(request: Request) -> JSONResponse:
        """Checkpoints with lineage, held-out and live numbers, deployments and traffic, the canary
        comparison, pipeline lag and recent deployment events, in one answer; plus who is asking."""
        body = dashboard_data(engine, settings, probe)
        key = getattr(request.state, "key", None)
        body["viewer"] = {"name": key.name, "role": key.role} if key is not None else None
        checked = DashboardPublic.model_validate(body)
        return JSONResponse(jsonable_encoder(checked.model_dump(mode="json")), headers={"Cache-Control": "no-store"})

    app.include_router(data)

    @app.get(PAGE_PATH, include_in_schema=False, name="dashboard.page")
    def page() -> FileResponse:
        """The page shell (no data: it logs in and reads ``/v1/dashboard`` itself)."""
        return FileResponse(
            STATIC_DIR / "index.html", media_type="text/html", headers={**SECURITY_HEADERS, "Cache-Control": "no-cache"}
        )

    @app.get(PLOTLY_PATH, include_in_schema=False, name="dashboard.plotly")
    def plotly_file() -> FileResponse:
        """Plotly.js from the installed ``plotly`` package."""
        return FileResponse(
            plotly_js,
            media_type="text/javascript",
            headers={"Cache-Control": "public, max-age=86400", "X-Content-Type-Options": "nosniff"},
        )

    app.mount(STATIC_PATH, StaticFiles(directory=STATIC_DIR), name="dashboard.static")

    check_dashboard_routes(app)


def check_dashboard_routes(app: FastAPI) -> None:
    """Raise ``RuntimeError`` unless ``GET /v1/dashboard`` carries a viewer (or stronger) auth dependency."""
    for route in app.routes:
        if isinstance(route, APIRoute) and route.path == DATA_PATH:
            roles = [getattr(dep.call, "required_role", None) for dep in route.dependant.dependencies]
            if any(roles):
                return
            raise RuntimeError(f"{DATA_PATH}: no auth dependency")
    raise RuntimeError(f"{DATA_PATH}: route missing")
