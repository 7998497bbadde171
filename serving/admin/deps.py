"""The admin API's FastAPI dependencies: its settings, its database, and who is calling with which role.

Route handlers take them as annotated parameters:

- :data:`AppSettings` and :data:`DbEngine`: the settings and the engine the app was built with;
- :data:`DbSession`: a SQLAlchemy session of that engine, closed when the handler returns
  (the handler commits what it writes);
- :data:`Viewer`, :data:`Operator`, :data:`Admin`: the :class:`Principal` of the request's
  bearer token, admitted when its role is the one named or a stronger one
  (``viewer`` < ``operator`` < ``admin``).

A missing, unknown or revoked token is refused with 401, a role below the route's (or a
gateway write key, role ``writer``) with 403 naming the role needed, as an
:class:`~serving.admin.errors.AdminError`. The token's key is also kept in
``request.state.key``, so a refusal that happens later is audited under its name.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from fastapi.security import HTTPBearer
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from flywheel.core.auth import KeyInfo, bearer_token, find_key
from flywheel.core.settings import Settings
from serving.admin.errors import AdminError
from serving.admin.schemas import OPS_ROLES

KEY_KINDS = {"writer": "gateway write key", "product": "router product key"}
"""What a key of a non-ops role is, for the 403 that refuses it."""
ROLE_RANK = {role: rank for rank, role in enumerate(OPS_ROLES, start=1)}
"""viewer < operator < admin; a token passes a route that needs its role or a weaker one."""
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
"""Methods that change nothing (everything else is a mutating call: operator or above, audited)."""

_BEARER = HTTPBearer(auto_error=False, description="An ops token (`flywheel tokens create`).")


# --------------------------------------------------------------------------- the app's own


def single_valued_query(request: Request) -> None:
    """Refuse (422, through the validation handler) a query parameter given more than once.

    Every parameter of the admin API takes one value; Starlette would keep the last of
    several silently, which hides a client's mistake.
    """
    counts = Counter(key for key, _ in request.query_params.multi_items())
    repeated = sorted(key for key, n in counts.items() if n > 1)
    if repeated:
        raise RequestValidationError(
            [
                {"loc": ("query", key), "msg": f"given {counts[key]} times; it takes one value", "type": "repeated"}
                for key in repeated
            ]
        )


def app_settings(request: Request) -> Settings:
    """The settings the app was built with."""
    return request.app.state.settings


def db_engine(request: Request) -> Engine:
    """The engine the app was built with."""
    return request.app.state.engine


AppSettings = Annotated[Settings, Depends(app_settings)]
DbEngine = Annotated[Engine, Depends(db_engine)]


def db_session(engine: DbEngine) -> Iterator[Session]:
    """A session of the app's engine, closed (what was not committed rolled back) when the handler returns."""
    with Session(engine) as session:
        yield session


DbSession = Annotated[Session, Depends(db_session, scope="function")]


# --------------------------------------------------------------------------- who is calling


@dataclass(frozen=True)
class Principal:
    """Who is calling: the ops token that authenticated the request."""

    key: KeyInfo

    @property
    def actor(self) -> str:
        """The audit log's name for the caller: ``token:<name>``."""
        return f"token:{self.key.name}"

    def details(self, **extra: Any) -> dict[str, Any]:
        """Audit details: ``extra`` without its None values, plus the token's id."""
        return {**{k: v for k, v in extra.items() if v is not None}, "token_id": self.key.id}


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
            f"a {info.role} key ({KEY_KINDS.get(info.role, 'key')} {info.token_prefix}…) is refused on the admin API; "
            "use an ops token (viewer, operator or admin)",
            required_role=role,
        )
    if ROLE_RANK[info.role] < ROLE_RANK[role]:
        raise AdminError(
            403, f"this route needs the {role} role; token {info.name!r} has {info.role}", required_role=role
        )


@functools.cache
def requires(role: str) -> Callable[..., Principal]:
    """The dependency admitting tokens of ``role`` or above (one per role, so a request authenticates once).

    The key is kept in ``request.state.key`` before its role is checked.
    """
    if role not in ROLE_RANK:
        raise ValueError(f"role: must be one of {', '.join(OPS_ROLES)} (got {role!r})")

    def dependency(request: Request, engine: DbEngine, _credentials: Any = Security(_BEARER)) -> Principal:
        info = authenticate(engine, request.headers.get("authorization"))
        request.state.key = info
        authorize(info, role)
        return Principal(info)

    dependency.required_role = role  # type: ignore[attr-defined]
    dependency.__name__ = f"requires_{role}"
    return dependency


Viewer = Annotated[Principal, Depends(requires("viewer"))]
Operator = Annotated[Principal, Depends(requires("operator"))]
Admin = Annotated[Principal, Depends(requires("admin"))]


def required_role(route: APIRoute) -> str | None:
    """The role a route's auth dependency demands (the strongest if several), or None if it has none."""
    roles = [getattr(dep.call, "required_role", None) for dep in route.dependant.dependencies]
    roles = [r for r in roles if r in ROLE_RANK]
    return max(roles, key=ROLE_RANK.__getitem__) if roles else None


def auth_refusal(request: Request) -> AdminError | None:
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
        request.state.key = authenticate(db_engine(request), request.headers.get("authorization"))
        authorize(request.state.key, role)
    except AdminError as refusal:
        return refusal
    return None
