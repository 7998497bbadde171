"""The admin API: checkpoints, the fleet, canary deployments, pause flags, the audit log, tokens.

Ops (and the ``flywheel`` CLI, which talks to nothing else) drive serving through this API.
Every route but ``/health`` needs a bearer token of an ops role, checked by a dependency of
the router the route belongs to, so a route cannot be added without it:

- ``viewer`` reads (checkpoints, fleet, canary and trainer state, the audit log, the OpenAPI
  schema and ``/docs``);
- ``operator`` also deploys a canary, changes its weight, promotes, rolls back, and pauses or
  resumes training and the canary controller;
- ``admin`` also lists, creates and revokes tokens.

Gateway write keys (role ``writer``) are refused (403). A missing, unknown or revoked token
gets 401 with ``WWW-Authenticate: Bearer``; a role below the route's gets 403 naming the role
needed. :func:`create_app` refuses to build an app in which a route escapes this rule.

Every mutating call is in the audit log: the deployment functions (``serving.deploy``) and the
pause flags write their own rows with the actor ``token:<name>``; token management writes its
rows here; and a mutating call refused for any reason (401, 403, 404, 409, 422, 5xx) that did
not reach one of those functions is recorded here with ``success = false``.

Errors are JSON ``{"error": kind, "reason": "..."}`` (:class:`~serving.admin_schemas.ErrorPublic`).
``serving.deploy.DeployError`` maps by kind: not_found → 404, conflict → 409, invalid → 422,
failed → 502. An authentication refusal takes precedence over a malformed body (FastAPI parses
the body before it runs dependencies; :func:`_auth_first` restores the order). Bodies over
64 KiB are refused (413) before they are read.

The OpenAPI schema (``/openapi.json``) and Swagger UI (``/docs``) need a viewer token like
every other route: the schema is a map of the ops surface, and "no route without
authentication but /health" is the rule (and the dashboard's page shell and static files, which hold no data: every number on the page comes from `/v1/...` with a token). Tools that read it send the header
(``curl -H 'Authorization: Bearer …'``, schemathesis ``-H``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Path, Query, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.routing import APIRoute
from fastapi.security import HTTPBearer
from sqlalchemy import func, select, text
from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from sqlalchemy.orm import Session
from starlette.exceptions import HTTPException as StarletteHTTPException

from flywheel.core.auth import KeyInfo, KeyNotFound, bearer_token, create_key, find_key, list_keys, revoke_key
from flywheel.core.db.models import CHECKPOINT_STATUSES, ROLES, ApiKey, AuditLog, Checkpoint
from serving.admin_schemas import (
    ID_PATTERN,
    OPS_ROLES,
    TEXT_PATTERN,
    AuditPage,
    AuditPublic,
    CanaryCreate,
    CanaryStatusPublic,
    CheckpointDetailPublic,
    CheckpointPage,
    CheckpointPublic,
    DeployResultPublic,
    ErrorPublic,
    FleetPublic,
    HeldoutEvalPublic,
    PauseRequest,
    PauseStatePublic,
    PromoteRequest,
    RollbackRequest,
    StatusPublic,
    TokenCreate,
    TokenCreated,
    TokenList,
    TokenPublic,
    WeightUpdate,
)
from serving.dashboard import PUBLIC_PATHS as DASHBOARD_PATHS
from serving.dashboard import install_dashboard

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from flywheel.core.settings import Settings

log = logging.getLogger(__name__)

ROLE_RANK = {role: rank for rank, role in enumerate(OPS_ROLES, start=1)}
"""viewer < operator < admin; a token passes a route that needs its role or a weaker one."""
PUBLIC_PATHS = frozenset({"/health"}) | DASHBOARD_PATHS
"""The only paths served without a token."""
MAX_BODY_BYTES = 64 * 1024
"""Largest request body read (every admin request is a small JSON object); 413 beyond."""
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
"""Methods that change nothing (everything else is a mutating call, audited)."""
DEPLOY_ERROR_STATUS = {"not_found": 404, "conflict": 409, "invalid": 422, "failed": 502}
"""HTTP status of each ``serving.deploy.DeployError`` kind."""
TOKEN_LOCK_KEY = 0x466C_544B
"""Advisory lock serialising token creation ('FlTK'): name uniqueness and the first-admin bootstrap."""
ERROR_KIND = {
    400: "invalid",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "too_large",
    422: "invalid",
    502: "failed",
    503: "unavailable",
}
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorPublic, "description": "Missing, unknown or revoked token."},
    403: {"model": ErrorPublic, "description": "The token's role is below the route's (or it is a gateway write key)."},
    422: {"model": ErrorPublic, "description": "Invalid request; `reason` names the field."},
}
"""Errors every protected route may answer (in the OpenAPI schema)."""

_BEARER = HTTPBearer(auto_error=False, description="An ops token (`flywheel tokens create`).")


class AdminError(Exception):
    """A refusal with its HTTP status, error kind and reason (answered as :class:`ErrorPublic`)."""

    def __init__(self, status: int, reason: str, *, kind: str | None = None, required_role: str | None = None):
        super().__init__(reason)
        self.status = status
        self.kind = kind or ERROR_KIND.get(status, "error")
        self.reason = reason
        self.required_role = required_role


# --------------------------------------------------------------------------- authentication


def authenticate(engine: Engine, authorization: str | None) -> KeyInfo:
    """The active key of an ``Authorization`` header (records its use), else raise a 401 :class:`AdminError`."""
    token = bearer_token(authorization)
    if token is None:
        if authorization:
            raise AdminError(401, "malformed Authorization header: expected 'Bearer <token>'")
        raise AdminError(401, "missing token: send 'Authorization: Bearer <token>' (see `flywheel tokens create`)")
    with Session(engine) as session:
        info = find_key(session, token, touch=True)
        if info is not None and info.active:
            session.commit()
    if info is None:
        raise AdminError(401, "unknown token")
    if not info.active:
        when = f"{info.revoked_at:%Y-%m-%d %H:%M:%S %Z}"
        raise AdminError(401, f"token {info.token_prefix}… ({info.name!r}) was revoked at {when}")
    return info


def authorize(info: KeyInfo, role: str) -> None:
    """Raise a 403 :class:`AdminError` unless ``info`` is an ops token of ``role`` or above."""
    if info.role not in ROLE_RANK:
        raise AdminError(
            403,
            f"a {info.role} key (gateway write key {info.token_prefix}…) is refused on the admin API; "
            "use an ops token (viewer, operator or admin)",
            required_role=role,
        )
    if ROLE_RANK[info.role] < ROLE_RANK[role]:
        raise AdminError(
            403, f"this route needs the {role} role; token {info.name!r} has {info.role}", required_role=role
        )


def requires(role: str) -> Callable[..., KeyInfo]:
    """A FastAPI dependency admitting tokens of ``role`` or above; the key is kept in ``request.state.key``."""
    if role not in ROLE_RANK:
        raise ValueError(f"role: must be one of {', '.join(OPS_ROLES)} (got {role!r})")

    def dependency(request: Request, _credentials: Any = Security(_BEARER)) -> KeyInfo:
        info = authenticate(request.app.state.engine, request.headers.get("authorization"))
        request.state.key = info
        authorize(info, role)
        return info

    dependency.required_role = role  # type: ignore[attr-defined]
    dependency.__name__ = f"requires_{role}"
    return dependency


def required_role(route: APIRoute) -> str | None:
    """The role a route's auth dependency demands (the strongest if several), or None if it has none."""
    roles = [getattr(dep.call, "required_role", None) for dep in route.dependant.dependencies]
    roles = [r for r in roles if r in ROLE_RANK]
    return max(roles, key=ROLE_RANK.__getitem__) if roles else None


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


def _actor(request: Request) -> str:
    key: KeyInfo | None = getattr(request.state, "key", None)
    return f"token:{key.name}" if key is not None else "anonymous"


def _token_details(request: Request, **extra: Any) -> dict[str, Any]:
    key: KeyInfo | None = getattr(request.state, "key", None)
    details = {k: v for k, v in extra.items() if v is not None}
    if key is not None:
        details["token_id"] = key.id
    return details


# --------------------------------------------------------------------------- tokens


def active_token_named(session: Session, name: str) -> bool:
    """Whether an unrevoked token has ``name``."""
    query = select(func.count()).select_from(ApiKey).where(ApiKey.name == name, ApiKey.revoked_at.is_(None))
    return (session.scalar(query) or 0) > 0


class BootstrapRefused(Exception):
    """The first-admin bootstrap does not apply (an admin token exists, or the request is not for one)."""


def bootstrap_admin_token(engine: Engine, name: str, actor: str) -> tuple[KeyInfo, str]:
    """Create the first admin token directly in Postgres, when no active admin token exists.

    This is how ``flywheel tokens create`` starts a fresh deployment: every later token is
    created through the API by an admin. The creation is audited (``token.create``,
    ``details.bootstrap``). Raises :class:`BootstrapRefused` when an active admin token exists
    or an active token already has ``name``.
    """
    with Session(engine) as session:
        session.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": TOKEN_LOCK_KEY})
        admin = session.scalars(
            select(ApiKey).where(ApiKey.role == "admin", ApiKey.revoked_at.is_(None)).order_by(ApiKey.id).limit(1)
        ).first()
        if admin is not None:
            raise BootstrapRefused(
                f"an active admin token exists ({admin.name!r}, {admin.token_prefix}…); "
                "create tokens through the admin API with an admin token (--token or FLYWHEEL_TOKEN)"
            )
        if active_token_named(session, name):
            raise BootstrapRefused(f"an active token is already named {name!r}; pick another name")
        info, token = create_key(session, name=name, role="admin", created_by=actor)
        session.add(
            AuditLog(
                actor=actor[:128],
                action="token.create",
                target=f"api_key:{info.id}",
                before=None,
                after=token_public(info).model_dump(mode="json"),
                details={"bootstrap": True},
                success=True,
            )
        )
        session.commit()
    return info, token


# --------------------------------------------------------------------------- audit


def write_audit(
    engine: Engine,
    *,
    actor: str,
    action: str,
    target: str | None,
    before: dict[str, Any] | None = None,
    after: dict[str, Any] | None = None,
    details: dict[str, Any] | None = None,
    success: bool = True,
) -> None:
    """Append one audit-log row (its own transaction)."""
    with Session(engine) as session:
        session.add(
            AuditLog(
                actor=actor[:128],
                action=action[:64],
                target=target[:256] if target else None,
                before=before,
                after=after,
                details=details or {},
                success=success,
            )
        )
        session.commit()


def _audit_target(request: Request, route: APIRoute) -> str:
    fleet = request.app.state.settings.serving.fleet
    if route.name.startswith("token."):
        token_id = request.path_params.get("token_id")
        return f"api_key:{token_id}" if token_id is not None else "api_keys"
    if route.name.startswith("trainer."):
        return "trainer"
    if route.name in ("canary.pause", "canary.resume"):
        return "canary"
    return f"fleet:{fleet}"


def _audit_refusal(request: Request, status: int, body: ErrorPublic) -> None:
    """Record a refused mutating call, unless the function it reached recorded it already."""
    route = request.scope.get("route")
    if request.method in READ_METHODS or not isinstance(route, APIRoute) or getattr(request.state, "audited", False):
        return
    details = _token_details(
        request, status=status, error=body.error, reason=body.reason, method=request.method, path=request.url.path
    )
    try:
        write_audit(
            request.app.state.engine,
            actor=_actor(request),
            action=route.name,
            target=_audit_target(request, route),
            details=details,
            success=False,
        )
    except SQLAlchemyError as err:  # the answer must still go out; the log says the row is missing
        log.error(
            "could not write the audit row of a refused %s %s: %s",
            request.method,
            request.url.path,
            str(getattr(err, "orig", None) or err).strip().splitlines()[0],
        )


@contextmanager
def _self_audited(request: Request) -> Iterator[None]:
    """Around a call that writes its own audit row, on success and on a DeployError."""
    from serving.fleet.registry import DeployError

    try:
        yield
    except DeployError:
        request.state.audited = True
        raise
    request.state.audited = True


# --------------------------------------------------------------------------- errors


def _error_response(
    request: Request, status: int, body: ErrorPublic, headers: dict[str, str] | None = None
) -> JSONResponse:
    _audit_refusal(request, status, body)
    if status == 401:
        headers = {**(headers or {}), "WWW-Authenticate": "Bearer"}
    return JSONResponse(status_code=status, content=body.model_dump(mode="json", exclude_none=True), headers=headers)


def _field(loc: tuple[Any, ...] | list[Any]) -> str:
    return ".".join(str(part) for part in loc) or "request"


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error as :class:`ErrorPublic` (and audit refused mutating calls)."""
    from serving.fleet.registry import DeployError

    @app.exception_handler(AdminError)
    async def admin_error(request: Request, exc: AdminError) -> JSONResponse:
        body = ErrorPublic(error=exc.kind, reason=exc.reason, required_role=exc.required_role)
        return await _in_thread(_error_response, request, exc.status, body)

    @app.exception_handler(DeployError)
    async def deploy_error(request: Request, exc: DeployError) -> JSONResponse:
        status = DEPLOY_ERROR_STATUS.get(exc.kind, 502)
        body = ErrorPublic(error=exc.kind, reason=getattr(exc, "message", None) or str(exc))
        return await _in_thread(_error_response, request, status, body)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        refusal = await _in_thread(_auth_first, request)
        if refusal is not None:
            return await admin_error(request, refusal)
        errors = [
            {"loc": list(e.get("loc", ())), "msg": str(e.get("msg")), "type": str(e.get("type"))} for e in exc.errors()
        ]
        reason = "; ".join(f"{_field(e['loc'])}: {e['msg']}" for e in errors) or "invalid request"
        body = ErrorPublic(error="invalid", reason=reason, errors=errors)
        return await _in_thread(_error_response, request, 422, body)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code in (400, 413):  # raised while reading the body, before the auth dependency ran
            refusal = await _in_thread(_auth_first, request)
            if refusal is not None:
                return await admin_error(request, refusal)
        body = ErrorPublic(error=ERROR_KIND.get(exc.status_code, "error"), reason=str(exc.detail))
        return await _in_thread(_error_response, request, exc.status_code, body, exc.headers)

    @app.exception_handler(DBAPIError)
    async def database_error(request: Request, exc: DBAPIError) -> JSONResponse:
        log.error("database error on %s %s: %s", request.method, request.url.path, exc)
        reason = (
            "database unavailable"
            if exc.connection_invalidated or _is_connection_error(exc)
            else (f"database error: {type(exc.orig).__name__}")
        )
        return await _in_thread(_error_response, request, 503, ErrorPublic(error="unavailable", reason=reason))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        body = ErrorPublic(error="internal", reason=f"internal error: {type(exc).__name__}: {exc}")
        return await _in_thread(_error_response, request, 500, body)


def _auth_first(request: Request) -> AdminError | None:
    """The auth refusal of a request whose body failed before its route's auth dependency ran, if any.

    FastAPI reads and parses the body before it solves dependencies; without this a request
    with no token and a malformed body would get 422 instead of 401.
    """
    route = request.scope.get("route")
    if not isinstance(route, APIRoute) or getattr(request.state, "key", None) is not None:
        return None
    role = required_role(route)
    if role is None:
        return None
    try:
        request.state.key = authenticate(request.app.state.engine, request.headers.get("authorization"))
        authorize(request.state.key, role)
    except AdminError as refusal:
        return refusal
    return None


def _is_connection_error(exc: DBAPIError) -> bool:
    from sqlalchemy.exc import InterfaceError, OperationalError

    return isinstance(exc, (OperationalError, InterfaceError))


async def _in_thread(fn: Callable[..., JSONResponse], *args: Any) -> JSONResponse:
    from starlette.concurrency import run_in_threadpool

    return await run_in_threadpool(fn, *args)


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


# --------------------------------------------------------------------------- conversions


def heldout_summary(eval_: dict[str, Any] | None) -> HeldoutEvalPublic | None:
    """The held-out evaluation of a checkpoint's ``eval`` column: its gate's, else the first cached one."""
    eval_ = eval_ or {}
    gate = eval_.get("gate") or {}
    if gate.get("candidate"):
        cand = gate["candidate"]
        return HeldoutEvalPublic(
            success_rate=cand.get("success_rate"),
            n=cand.get("n"),
            key=gate.get("key"),
            gate_passed=gate.get("passed"),
            gate_reason=gate.get("reason"),
        )
    heldout = eval_.get("heldout") or {}
    if not heldout:
        return None
    key, result = sorted(heldout.items())[0]
    return HeldoutEvalPublic(success_rate=result.get("success_rate"), n=result.get("n"), key=key)


def checkpoint_public(row: Checkpoint) -> CheckpointPublic:
    """A registry row as listed."""
    return CheckpointPublic(
        id=row.id,
        policy_version=row.policy_version,
        parent_id=row.parent_id,
        status=row.status,
        status_reason=row.status_reason,
        format=row.format,
        n_samples=row.n_samples,
        created_at=row.created_at,
        last_deployed_at=row.last_deployed_at,
        heldout=heldout_summary(row.eval),
    )


def checkpoint_detail(row: Checkpoint) -> CheckpointDetailPublic:
    """A registry row with everything recorded."""
    return CheckpointDetailPublic(
        **checkpoint_public(row).model_dump(),
        base_model=row.base_model,
        path=row.path,
        data_window_start=row.data_window_start,
        data_window_end=row.data_window_end,
        config_hash=row.config_hash,
        sample_ids_hash=row.sample_ids_hash,
        metrics=row.metrics or {},
        eval=row.eval or {},
    )


def token_public(info: KeyInfo) -> TokenPublic:
    """A key as listed (never the token or its hash)."""
    return TokenPublic(
        id=info.id,
        name=info.name,
        role=info.role,
        project=info.project,
        token_prefix=info.token_prefix,
        created_at=info.created_at,
        revoked_at=info.revoked_at,
        last_used_at=info.last_used_at,
        active=info.active,
    )


def _pause_public(state: Any) -> PauseStatePublic:
    return PauseStatePublic(paused=state.paused, actor=state.actor, at=state.at, reason=state.reason)


def _deploy_result(action: str, actor: str, result: Any) -> DeployResultPublic:
    return DeployResultPublic(action=action, actor=actor, **_as_dict(result))


def _as_dict(value: Any) -> dict[str, Any]:
    if hasattr(value, "to_dict"):
        value = value.to_dict()
    return value if isinstance(value, dict) else {"value": value}


# --------------------------------------------------------------------------- routes


def _read_routes(router: APIRouter) -> None:
    @router.get("/checkpoints", response_model=CheckpointPage, name="checkpoints.list")
    def list_checkpoints(
        request: Request,
        limit: int = Query(50, ge=1, le=500, description="Page size."),
        offset: int = Query(0, ge=0, le=2**31 - 1, description="Checkpoints to skip (newest first)."),
        status: Literal[CHECKPOINT_STATUSES] | None = Query(  # type: ignore[valid-type]
            None, description="Only checkpoints of this status."
        ),
    ) -> CheckpointPage:
        """Checkpoints of the registry, newest first, with status, parent, policy version and held-out eval."""
        query = select(Checkpoint)
        count = select(func.count()).select_from(Checkpoint)
        if status is not None:
            query, count = query.where(Checkpoint.status == status), count.where(Checkpoint.status == status)
        query = query.order_by(Checkpoint.created_at.desc(), Checkpoint.id.desc()).limit(limit).offset(offset)
        with Session(request.app.state.engine) as session:
            rows = list(session.scalars(query))
            total = session.scalar(count) or 0
        return CheckpointPage(items=[checkpoint_public(r) for r in rows], total=total, limit=limit, offset=offset)

    @router.get(
        "/checkpoints/{checkpoint_id}",
        response_model=CheckpointDetailPublic,
        name="checkpoints.show",
        responses={404: {"model": ErrorPublic, "description": "No such checkpoint."}},
    )
    def show_checkpoint(
        request: Request, checkpoint_id: str = Path(min_length=1, max_length=64, pattern=ID_PATTERN)
    ) -> CheckpointDetailPublic:
        """One checkpoint with its metrics, evaluation and data window."""
        with Session(request.app.state.engine) as session:
            row = session.get(Checkpoint, checkpoint_id)
            if row is None:
                raise AdminError(404, f"no checkpoint {checkpoint_id!r} in the registry")
            return checkpoint_detail(row)

    @router.get("/fleet", response_model=FleetPublic, name="fleet.show")
    def fleet(request: Request) -> dict[str, Any]:
        """The fleet's stable and canary deployments and its replicas (``serving.deploy.fleet_status``)."""
        from serving.fleet.registry import fleet_status

        return _as_dict(fleet_status(request.app.state.engine, request.app.state.settings.serving.fleet))

    @router.get("/status", response_model=StatusPublic, name="status.show")
    def status(request: Request) -> StatusPublic:
        """Fleet status plus the trainer's and the canary controller's pause flags."""
        from flywheel.core.pause import pause_state
        from serving.canary.controller import canary_pause_state
        from serving.fleet.registry import fleet_status

        app_state = request.app.state
        fleet_ = _as_dict(fleet_status(app_state.engine, app_state.settings.serving.fleet))
        with Session(app_state.engine) as session:
            trainer, canary = pause_state(session, "trainer"), canary_pause_state(session)
        return StatusPublic(fleet=fleet_, trainer=_pause_public(trainer), canary_controller=_pause_public(canary))

    @router.get("/canary", response_model=CanaryStatusPublic, name="canary.show")
    def canary_status(request: Request) -> CanaryStatusPublic:
        """The canary controller's pause flag and the fleet's canary and stable deployments."""
        from serving.canary.controller import canary_pause_state
        from serving.fleet.registry import fleet_status

        app_state = request.app.state
        serving = app_state.settings.serving
        fleet_ = _as_dict(fleet_status(app_state.engine, serving.fleet))
        with Session(app_state.engine) as session:
            state = canary_pause_state(session)
        return CanaryStatusPublic(
            fleet=serving.fleet,
            enabled=serving.canary.enabled,
            controller=_pause_public(state),
            canary=fleet_.get("canary"),
            stable=fleet_.get("stable"),
        )

    @router.get("/trainer", response_model=PauseStatePublic, name="trainer.show")
    def trainer_status(request: Request) -> PauseStatePublic:
        """The trainer's pause flag."""
        from flywheel.core.pause import pause_state

        with Session(request.app.state.engine) as session:
            return _pause_public(pause_state(session, "trainer"))

    @router.get("/audit", response_model=AuditPage, name="audit.list")
    def audit(
        request: Request,
        limit: int = Query(50, ge=1, le=500, description="Page size."),
        offset: int = Query(0, ge=0, le=2**31 - 1, description="Entries to skip (newest first)."),
        action: str | None = Query(
            None, max_length=64, pattern=TEXT_PATTERN, description="Only this action (e.g. `deploy.promote`)."
        ),
        action_prefix: str | None = Query(
            None, max_length=64, pattern=TEXT_PATTERN, description="Only actions starting with this (e.g. `token.`)."
        ),
        actor: str | None = Query(
            None, max_length=128, pattern=TEXT_PATTERN, description="Only this actor (e.g. `token:alice`)."
        ),
        target: str | None = Query(None, max_length=256, pattern=TEXT_PATTERN, description="Only this target."),
        success: bool | None = Query(None, description="Only successful (true) or failed (false) calls."),
        since: datetime | None = Query(None, description="Only entries at or after this time."),
        until: datetime | None = Query(None, description="Only entries before this time."),
    ) -> AuditPage:
        """Recent audit-log entries, newest first, with filters."""
        query = select(AuditLog)
        if action is not None:
            query = query.where(AuditLog.action == action)
        if action_prefix is not None:
            query = query.where(AuditLog.action.startswith(action_prefix, autoescape=True))
        if actor is not None:
            query = query.where(AuditLog.actor == actor)
        if target is not None:
            query = query.where(AuditLog.target == target)
        if success is not None:
            query = query.where(AuditLog.success.is_(success))
        if since is not None:
            query = query.where(AuditLog.at >= since)
        if until is not None:
            query = query.where(AuditLog.at < until)
        query = query.order_by(AuditLog.id.desc()).limit(limit).offset(offset)
        with Session(request.app.state.engine) as session:
            items = [AuditPublic.model_validate(row, from_attributes=True) for row in session.scalars(query)]
        return AuditPage(items=items, limit=limit, offset=offset)


DEPLOY_RESPONSES: dict[int | str, dict[str, Any]] = {
    404: {"model": ErrorPublic, "description": "The checkpoint (or deployment) does not exist."},
    409: {"model": ErrorPublic, "description": "The fleet's state does not allow it (e.g. no canary to promote)."},
    502: {"model": ErrorPublic, "description": "The swap failed on a replica; the deployment is marked failed."},
}


def _operator_routes(router: APIRouter) -> None:
    @router.post("/canary", response_model=DeployResultPublic, name="deploy.canary", responses=DEPLOY_RESPONSES)
    def deploy_canary(request: Request, body: CanaryCreate) -> DeployResultPublic:
        """Deploy a checkpoint as the fleet's canary with a traffic weight (hot swap, one replica at a time)."""
        from serving.fleet import deploy

        app_state, actor = request.app.state, _actor(request)
        with _self_audited(request):
            result = deploy.deploy_canary(
                app_state.engine,
                app_state.settings,
                body.checkpoint_id,
                body.weight,
                actor,
                details=_token_details(request),
            )
        return _deploy_result("deploy.canary", actor, result)

    @router.put("/canary/weight", response_model=DeployResultPublic, name="deploy.weight", responses=DEPLOY_RESPONSES)
    def set_weight(request: Request, body: WeightUpdate) -> DeployResultPublic:
        """Change the canary's share of new sessions."""
        from serving.fleet import deploy

        app_state, actor = request.app.state, _actor(request)
        with _self_audited(request):
            result = deploy.set_canary_weight(
                app_state.engine,
                app_state.settings,
                body.weight,
                actor,
                details=_token_details(request, reason=body.reason),
            )
        return _deploy_result("deploy.weight", actor, result)

    @router.post("/promote", response_model=DeployResultPublic, name="deploy.promote", responses=DEPLOY_RESPONSES)
    def promote(request: Request, body: PromoteRequest | None = None) -> DeployResultPublic:
        """Promote the canary: its checkpoint becomes stable on every replica."""
        from serving.fleet import deploy

        app_state, actor = request.app.state, _actor(request)
        reason = body.reason if body else None
        with _self_audited(request):
            result = deploy.promote(
                app_state.engine, app_state.settings, actor, details=_token_details(request, reason=reason)
            )
        return _deploy_result("deploy.promote", actor, result)

    @router.post("/rollback", response_model=DeployResultPublic, name="deploy.rollback", responses=DEPLOY_RESPONSES)
    def rollback(request: Request, body: RollbackRequest | None = None) -> DeployResultPublic:
        """Roll back: end the canary (back to the previous stable), or serve a given checkpoint as stable."""
        from serving.fleet import deploy

        app_state, actor = request.app.state, _actor(request)
        body = body or RollbackRequest()
        with _self_audited(request):
            result = deploy.rollback(
                app_state.engine,
                app_state.settings,
                actor,
                to_checkpoint_id=body.to_checkpoint_id,
                details=_token_details(request, reason=body.reason),
            )
        return _deploy_result("deploy.rollback", actor, result)

    def _trainer_flag(request: Request, paused: bool, body: PauseRequest | None) -> PauseStatePublic:
        from flywheel.core.pause import set_paused

        with Session(request.app.state.engine) as session:
            state = set_paused(session, "trainer", paused, _actor(request), body.reason if body else None)
        request.state.audited = True
        return _pause_public(state)

    def _canary_flag(request: Request, paused: bool, body: PauseRequest | None) -> PauseStatePublic:
        from serving.canary.controller import set_canary_paused

        with Session(request.app.state.engine) as session:
            state = set_canary_paused(session, paused, _actor(request), body.reason if body else None)
        request.state.audited = True
        return _pause_public(state)

    @router.post("/trainer/pause", response_model=PauseStatePublic, name="trainer.pause")
    def pause_trainer(request: Request, body: PauseRequest | None = None) -> PauseStatePublic:
        """Pause training: later cycles are skipped (reason ``paused``) until resumed."""
        return _trainer_flag(request, True, body)

    @router.post("/trainer/resume", response_model=PauseStatePublic, name="trainer.resume")
    def resume_trainer(request: Request, body: PauseRequest | None = None) -> PauseStatePublic:
        """Resume training."""
        return _trainer_flag(request, False, body)

    @router.post("/canary/pause", response_model=PauseStatePublic, name="canary.pause")
    def pause_canary(request: Request, body: PauseRequest | None = None) -> PauseStatePublic:
        """Pause the canary controller: it stops stepping, promoting and rolling back until resumed."""
        return _canary_flag(request, True, body)

    @router.post("/canary/resume", response_model=PauseStatePublic, name="canary.resume")
    def resume_canary(request: Request, body: PauseRequest | None = None) -> PauseStatePublic:
        """Resume the canary controller."""
        return _canary_flag(request, False, body)


def _admin_routes(router: APIRouter) -> None:
    @router.get("/tokens", response_model=TokenList, name="token.list")
    def tokens(
        request: Request,
        role: Literal[ROLES] | None = Query(None, description="Only tokens of this role."),  # type: ignore[valid-type]
    ) -> TokenList:
        """Every token (ops tokens and gateway write keys), newest first; never the tokens themselves."""
        with Session(request.app.state.engine) as session:
            return TokenList(items=[token_public(k) for k in list_keys(session, role=role)])

    @router.post(
        "/tokens",
        response_model=TokenCreated,
        status_code=201,
        name="token.create",
        responses={409: {"model": ErrorPublic, "description": "An active token has that name."}},
    )
    def create_token(request: Request, body: TokenCreate) -> TokenCreated:
        """Create an ops token; the token is in this answer only (the database keeps its hash)."""
        actor = _actor(request)
        with Session(request.app.state.engine) as session:
            session.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": TOKEN_LOCK_KEY})
            if active_token_named(session, body.name):
                raise AdminError(409, f"an active token is already named {body.name!r}; revoke it or pick another name")
            info, token = create_key(session, name=body.name, role=body.role, created_by=actor)
            public = token_public(info)
            session.add(
                AuditLog(
                    actor=actor,
                    action="token.create",
                    target=f"api_key:{info.id}",
                    before=None,
                    after=public.model_dump(mode="json"),
                    details=_token_details(request),
                    success=True,
                )
            )
            session.commit()
        request.state.audited = True
        return TokenCreated(**public.model_dump(), token=token)

    @router.delete(
        "/tokens/{token_id}",
        response_model=TokenPublic,
        name="token.revoke",
        responses={404: {"model": ErrorPublic, "description": "No token with that id."}},
    )
    def revoke_token(request: Request, token_id: int = Path(ge=1, le=2**63 - 1)) -> TokenPublic:
        """Revoke a token (immediately: the admin API does not cache tokens). Idempotent."""
        actor = _actor(request)
        with Session(request.app.state.engine) as session:
            row = session.get(ApiKey, token_id)
            if row is None:
                raise AdminError(404, f"no token with id {token_id}")
            before = {"active": row.revoked_at is None, "name": row.name, "role": row.role}
            try:
                info = revoke_key(session, token_id)
            except KeyNotFound as err:  # deleted between the two reads
                raise AdminError(404, str(err)) from None
            public = token_public(info)
            session.add(
                AuditLog(
                    actor=actor,
                    action="token.revoke",
                    target=f"api_key:{token_id}",
                    before=before,
                    after={
                        "active": False,
                        "name": info.name,
                        "role": info.role,
                        "revoked_at": public.revoked_at.isoformat() if public.revoked_at else None,
                    },
                    details=_token_details(request),
                    success=True,
                )
            )
            session.commit()
        request.state.audited = True
        return public


def _docs_routes(router: APIRouter) -> None:
    @router.get("/openapi.json", include_in_schema=False, name="openapi")
    def openapi(request: Request) -> JSONResponse:
        """The OpenAPI schema (a viewer token is needed: no route is public but /health)."""
        return JSONResponse(request.app.openapi())

    @router.get("/docs", include_in_schema=False, name="docs")
    def docs(request: Request) -> HTMLResponse:
        """Swagger UI over /openapi.json."""
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{request.app.title} - docs")


# --------------------------------------------------------------------------- app


def create_app(settings: Settings, engine: Engine | None = None) -> FastAPI:
    """The admin API over ``engine`` (default: the settings' Postgres), managing ``serving.fleet``."""
    if engine is None:
        from flywheel.core.db.engine import get_engine
        from flywheel.core.endpoints import postgres_url

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
    )
    app.state.engine = engine
    app.state.settings = settings
    install_error_handlers(app)
    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES)

    routers = {
        "viewer": APIRouter(prefix="/v1", dependencies=[Depends(requires("viewer"))], responses=ERROR_RESPONSES),
        "operator": APIRouter(prefix="/v1", dependencies=[Depends(requires("operator"))], responses=ERROR_RESPONSES),
        "admin": APIRouter(prefix="/v1", dependencies=[Depends(requires("admin"))], responses=ERROR_RESPONSES),
    }
    _read_routes(routers["viewer"])
    _operator_routes(routers["operator"])
    _admin_routes(routers["admin"])
    docs = APIRouter(dependencies=[Depends(requires("viewer"))])
    _docs_routes(docs)
    for router in (*routers.values(), docs):
        app.include_router(router)

    @app.get("/health", name="health", responses={503: {"model": ErrorPublic}})
    def health() -> JSONResponse:
        """Liveness and database reachability; the only route without a token."""
        try:
            with engine.connect() as conn:
                conn.execute(text("SELECT 1"))
        except SQLAlchemyError as err:
            return JSONResponse(status_code=503, content={"status": "unavailable", "database": type(err).__name__})
        return JSONResponse({"status": "ok"})

    install_dashboard(app, settings, engine, requires)
    check_routes_protected(app)
    return app


def serve(settings: Settings) -> None:
    """Serve the admin API with uvicorn on ``serving.admin_host:admin_port`` until stopped."""
    import uvicorn

    app = create_app(settings)
    log.info(
        "admin API for fleet %s on %s:%s",
        settings.serving.fleet,
        settings.serving.admin_host,
        settings.serving.admin_port,
    )
    uvicorn.run(app, host=settings.serving.admin_host, port=settings.serving.admin_port, log_level="info")
