"""The admin API's refusals: :class:`AdminError`, the error kinds and the errors each route documents.

Every error is answered as :class:`~serving.admin.schemas.ErrorPublic`
(``{"error": kind, "reason": "..."}``) by the handlers :func:`serving.admin.app.create_app`
installs. ``serving.fleet.registry.DeployError`` maps by kind (:data:`DEPLOY_ERROR_STATUS`):
not_found → 404, conflict → 409, invalid → 422, failed → 502.
"""

from __future__ import annotations

from typing import Any

from serving.admin.schemas import ErrorPublic

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
"""The ``error`` of each HTTP status."""
DEPLOY_ERROR_STATUS = {"not_found": 404, "conflict": 409, "invalid": 422, "failed": 502}
"""HTTP status of each ``serving.fleet.registry.DeployError`` kind."""
OPERATION_ERROR_STATUS = {**DEPLOY_ERROR_STATUS, "internal": 500, "abandoned": 502}
"""HTTP status of a failed operation's ``error`` (answered with ``?wait=true``)."""
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorPublic, "description": "Missing, unknown or revoked token."},
    403: {"model": ErrorPublic, "description": "The token's role is below the route's (or it is a gateway write key)."},
    422: {"model": ErrorPublic, "description": "Invalid request; `reason` names the field."},
}
"""Errors every protected route may answer (in the OpenAPI schema)."""
DEPLOY_RESPONSES: dict[int | str, dict[str, Any]] = {
    404: {"model": ErrorPublic, "description": "The checkpoint (or deployment) does not exist."},
    409: {"model": ErrorPublic, "description": "The fleet's state does not allow it (e.g. no canary to promote)."},
    502: {
        "model": ErrorPublic,
        "description": "With ?wait=true: the swap failed on a replica; the deployment is marked failed.",
    },
    503: {"model": ErrorPublic, "description": "The database is unavailable, or this admin API process is stopping."},
}
"""Errors of the deployment routes (in the OpenAPI schema)."""


class AdminError(Exception):
    """A refusal with its HTTP status, error kind and reason (answered as :class:`ErrorPublic`)."""

    def __init__(
        self,
        status: int,
        reason: str,
        *,
        kind: str | None = None,
        required_role: str | None = None,
        operation_id: str | None = None,
    ):
        super().__init__(reason)
        self.status = status
        self.kind = kind or ERROR_KIND.get(status, "error")
        self.reason = reason
        self.required_role = required_role
        self.operation_id = operation_id
