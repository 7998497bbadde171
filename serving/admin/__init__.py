"""The admin API: checkpoints, the fleet, canary deployments, pause flags, the audit log, tokens.

Ops (and the ``flywheel`` CLI, which talks to nothing else) drive serving through this API.
Roles, weakest first: ``viewer`` reads (checkpoints, fleet, canary and trainer state, the
audit log, the OpenAPI schema and ``/docs``); ``operator`` also deploys a canary, changes its
weight, promotes, rolls back, and pauses or resumes training and the canary controller;
``admin`` also lists, creates and revokes tokens. Gateway write keys (role ``writer``) are
refused.

- :mod:`serving.admin.app`: :func:`create_app` (routes, error handlers, body limit, the
  dashboard) and :func:`serve`;
- :mod:`serving.admin.deps`: the ``Annotated`` dependencies (settings, database, the calling
  token and its role);
- :mod:`serving.admin.routes`: one ``APIRouter`` per concern;
- :mod:`serving.admin.operations`: deploy, weight, promote and rollback as operations (202 with
  an id at once, run by a thread of the process, followed at ``GET /v1/operations/{id}``,
  ``?wait=true`` for the synchronous answer; leases fail an operation whose process died);
- :mod:`serving.admin.errors`, :mod:`serving.admin.audit`, :mod:`serving.admin.tokens`,
  :mod:`serving.admin.schemas`.

``create_app``, ``serve`` and ``requires`` are importable from here; they are loaded on first
use, because the app mounts the dashboard, which imports :mod:`serving.admin.deps` (importing
the app here would make that a cycle).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"create_app": "serving.admin.app", "serve": "serving.admin.app", "requires": "serving.admin.deps"}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
