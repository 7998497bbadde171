"""The admin API app: its routes, its error handlers, its body limit, the dashboard, and the rule that guards them.

Every route but ``/health`` needs a bearer token of an ops role, declared by the route's
handler (:mod:`serving.admin.deps`); :func:`create_app` refuses to build an app in which a
route escapes this rule (:func:`check_routes_protected`): the only paths served without a
token are :data:`PUBLIC_PATHS`, ``/health`` and the dashboard's page shell and static
files, which hold no data (every number on the page comes from ``/v1/...`` with a token).

Errors are JSON ``{"error": kind, "reason": "..."}`` (:class:`~serving.admin.schemas.ErrorPublic`),
answered by the handlers :func:`install_error_handlers` adds; a refused mutating call is
audited (:func:`serving.admin.audit.audit_refusal`). An authentication refusal takes
precedence over a malformed body (FastAPI parses the body before it runs dependencies;
:func:`serving.admin.deps.auth_refusal` restores the order). Bodies over 64 KiB are refused
(413) before they are read (:class:`BodyLimit`).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from flywheel.core.db.engine import get_engine
from flywheel.core.endpoints import postgres_url
from flywheel.core.settings import Settings
from serving.admin.audit import audit_refusal
from serving.admin.deps import READ_METHODS, ROLE_RANK, auth_refusal, required_role, single_valued_query
from serving.admin.errors import DEPLOY_ERROR_STATUS, ERROR_KIND, AdminError
from serving.admin.operations import OperationRunner
from serving.admin.routes import ROUTERS
from serving.admin.schemas import ErrorPublic
from serving.dashboard import PUBLIC_PATHS as DASHBOARD_PATHS
from serving.dashboard import install_dashboard
from serving.fleet.registry import DeployError

log = logging.getLogger(__name__)

PUBLIC_PATHS = frozenset({"/health"}) | DASHBOARD_PATHS
"""The only paths served without a token."""
MAX_BODY_BYTES = 64 * 1024
"""Largest request body read (every admin request is a small JSON object); 413 beyond."""


# --------------------------------------------------------------------------- the rule


def check_routes_protected(app: FastAPI) -> None:
    """Raise ``RuntimeError`` if :func:`route_problems` finds any."""
    problems = route_problems(app)
    if problems:
        raise RuntimeError("admin API routes without proper authentication: " + "; ".join(problems))


def route_problems(app: FastAPI) -> list[str]:
    """Routes (but :data:`PUBLIC_PATHS`) without an auth dependency, or mutating ones open to viewers."""
    problems = []
    for route in app.routes:
        path = getattr(route, "path", repr(route))
        if path in PUBLIC_PATHS:
            continue
        if not isinstance(route, APIRoute):
            problems.append(f"{path}: not an APIRoute, so it cannot carry the auth dependency")
            continue
        role = required_role(route)
        if role is None:
            problems.append(f"{path}: no auth dependency")
        elif set(route.methods) - READ_METHODS and ROLE_RANK[role] < ROLE_RANK["operator"]:
            problems.append(f"{path}: mutating route open to {role}")
    return problems


# --------------------------------------------------------------------------- errors


def _error_response(
    request: Request, status: int, body: ErrorPublic, headers: dict[str, str] | None = None
) -> JSONResponse:
    audit_refusal(request, status, body)
    if status == 401:
        headers = {**(headers or {}), "WWW-Authenticate": "Bearer"}
    return JSONResponse(status_code=status, content=body.model_dump(mode="json", exclude_none=True), headers=headers)


def _field(loc: tuple[Any, ...] | list[Any]) -> str:
    return ".".join(str(part) for part in loc) or "request"


def _is_connection_error(exc: DBAPIError) -> bool:
    return isinstance(exc, (OperationalError, InterfaceError))


async def _in_thread(fn: Callable[..., JSONResponse], *args: Any) -> JSONResponse:
    return await run_in_threadpool(fn, *args)


async def admin_error(request: Request, exc: AdminError) -> JSONResponse:
    """An :class:`AdminError` as its status and body."""
    body = ErrorPublic(
        error=exc.kind, reason=exc.reason, required_role=exc.required_role, operation_id=exc.operation_id
    )
    return await _in_thread(_error_response, request, exc.status, body)


async def deploy_error(request: Request, exc: DeployError) -> JSONResponse:
    """A ``DeployError`` as the status of its kind."""
    status = DEPLOY_ERROR_STATUS.get(exc.kind, 502)
    body = ErrorPublic(error=exc.kind, reason=getattr(exc, "message", None) or str(exc))
    return await _in_thread(_error_response, request, status, body)


async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """422 naming each invalid field, unless the request's token is refused first."""
    refusal = await _in_thread(auth_refusal, request)
    if refusal is not None:
        return await admin_error(request, refusal)
    errors = [
        {"loc": list(e.get("loc", ())), "msg": str(e.get("msg")), "type": str(e.get("type"))} for e in exc.errors()
    ]
    reason = "; ".join(f"{_field(e['loc'])}: {e['msg']}" for e in errors) or "invalid request"
    body = ErrorPublic(error="invalid", reason=reason, errors=errors)
    return await _in_thread(_error_response, request, 422, body)


async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's and FastAPI's own refusals (404, 405, 400 and 413 while reading the body)."""
    if exc.status_code in (400, 413):  # raised while reading the body, before the auth dependency ran
        refusal = await _in_thread(auth_refusal, request)
        if refusal is not None:
            return await admin_error(request, refusal)
    body = ErrorPublic(error=ERROR_KIND.get(exc.status_code, "error"), reason=str(exc.detail))
    return await _in_thread(_error_response, request, exc.status_code, body, exc.headers)


async def database_error(request: Request, exc: DBAPIError) -> JSONResponse:
    """503: the database is unreachable or refused the statement."""
    log.error("database error on %s %s: %s", request.method, request.url.path, exc)
    reason = (
        "database unavailable"
        if exc.connection_invalidated or _is_connection_error(exc)
        else (f"database error: {type(exc.orig).__name__}")
    )
    return await _in_thread(_error_response, request, 503, ErrorPublic(error="unavailable", reason=reason))


async def internal_error(request: Request, exc: Exception) -> JSONResponse:
    """500 with the exception's type and message (and its traceback in the log)."""
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    body = ErrorPublic(error="internal", reason=f"internal error: {type(exc).__name__}: {exc}")
    return await _in_thread(_error_response, request, 500, body)


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error as :class:`ErrorPublic` (and audit refused mutating calls)."""
    app.add_exception_handler(AdminError, admin_error)
    app.add_exception_handler(DeployError, deploy_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(DBAPIError, database_error)
    app.add_exception_handler(Exception, internal_error)


class BodyLimit:
    """ASGI middleware: refuse (413) a request whose body is, or declares to be, over ``limit`` bytes."""

    def __init__(self, app: Any, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            await self._refuse(scope, receive, send, declared.decode("latin-1"))
            return
        seen = 0

        async def limited() -> Any:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:  # FastAPI re-raises an HTTPException met while reading the body
                    raise HTTPException(413, f"request body over the limit of {self.limit} bytes")
            return message

        await self.app(scope, limited, send)

    async def _refuse(self, scope: Any, receive: Any, send: Any, declared: str) -> None:
        reason = (
            f"request body of {declared} bytes is over the limit of {self.limit} bytes"
            if declared.isdigit()
            else f"invalid Content-Length header {declared!r}"
        )
        body = ErrorPublic(error="too_large" if declared.isdigit() else "invalid", reason=reason)
        status = 413 if declared.isdigit() else 400
        response = JSONResponse(status_code=status, content=body.model_dump(exclude_none=True))
        await response(scope, receive, send)


# --------------------------------------------------------------------------- app


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """At start, mark operations abandoned by dead processes; at the end, let this process's operations finish."""
    runner: OperationRunner = app.state.operations
    await run_in_threadpool(runner.start)
    try:
        yield
    finally:
        await run_in_threadpool(runner.close)


def create_app(settings: Settings, engine: Engine | None = None) -> FastAPI:
    """The admin API over ``engine`` (default: the settings' Postgres), managing ``serving.fleet``.

    Its deployment operations run in threads of this process (``app.state.operations``,
    :class:`~serving.admin.operations.OperationRunner`).
    """
    if engine is None:
        engine = get_engine(postgres_url(settings))
    app = FastAPI(
        title="Flywheel admin API",
        version="1",
        description=(
            "Checkpoints, the fleet, canary deployment, promotion and rollback, pause flags, the audit log and "
            "tokens. Every route but /health needs `Authorization: Bearer <ops token>` "
            "(viewer < operator < admin)."
        ),
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
        dependencies=[Depends(single_valued_query)],
        lifespan=lifespan,
    )
    app.state.engine = engine
    app.state.settings = settings
    app.state.operations = OperationRunner(engine, settings.serving.operation_lease_s)
    install_error_handlers(app)
    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES)
    for router in ROUTERS:
        app.include_router(router)
    install_dashboard(app, settings, engine)
    check_routes_protected(app)
    return app


def serve(settings: Settings) -> None:
    """Serve the admin API with uvicorn on ``serving.admin_host:admin_port`` until stopped."""
    app = create_app(settings)
    log.info(
        "admin API for fleet %s on %s:%s",
        settings.serving.fleet,
        settings.serving.admin_host,
        settings.serving.admin_port,
    )
    uvicorn.run(app, host=settings.serving.admin_host, port=settings.serving.admin_port, log_level="info")
