"""The admin API's routes, one module per concern, each an ``APIRouter`` of plain handlers.

Each handler declares the role it needs as a parameter (``Viewer``, ``Operator``, ``Admin``
from :mod:`serving.admin.deps`); :func:`serving.admin.app.check_routes_protected` refuses an
app in which a route has none (``/health`` and the dashboard's page shell excepted).
"""

from __future__ import annotations

from fastapi import APIRouter

from serving.admin.routes import (
    audit,
    canary,
    checkpoints,
    deployments,
    docs,
    health,
    operations,
    status,
    tokens,
    trainer,
)

ROUTERS: tuple[APIRouter, ...] = (
    checkpoints.router,
    status.router,
    canary.router,
    trainer.router,
    audit.router,
    deployments.router,
    operations.router,
    tokens.router,
    docs.router,
    health.router,
)
"""In the order the app includes them (``GET /v1/canary`` before ``POST /v1/canary``: a method that
neither allows is answered, and audited, by the first)."""
