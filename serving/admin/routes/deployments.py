"""Deployment operations (operator): deploy a canary, change its weight, promote, roll back.

Each calls its ``serving.fleet.deploy`` function, which holds the fleet's lock, runs the
swaps and writes the audit row under the token's name (also when it is refused or fails).
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from serving.admin.audit import self_audited
from serving.admin.deps import AppSettings, DbEngine, Operator
from serving.admin.errors import DEPLOY_RESPONSES, ERROR_RESPONSES
from serving.admin.schemas import (
    CanaryCreate,
    DeployResultPublic,
    PromoteRequest,
    RollbackRequest,
    WeightUpdate,
    deploy_result,
)
from serving.fleet import deploy

router = APIRouter(prefix="/v1", responses=ERROR_RESPONSES)


@router.post("/canary", response_model=DeployResultPublic, name="deploy.canary", responses=DEPLOY_RESPONSES)
def deploy_canary(
    operator: Operator, settings: AppSettings, engine: DbEngine, request: Request, body: CanaryCreate
) -> DeployResultPublic:
    """Deploy a checkpoint as the fleet's canary with a traffic weight (hot swap, one replica at a time)."""
    with self_audited(request):
        result = deploy.deploy_canary(
            engine, settings, body.checkpoint_id, body.weight, operator.actor, details=operator.details()
        )
    return deploy_result("deploy.canary", operator.actor, result)


@router.put("/canary/weight", response_model=DeployResultPublic, name="deploy.weight", responses=DEPLOY_RESPONSES)
def set_weight(
    operator: Operator, settings: AppSettings, engine: DbEngine, request: Request, body: WeightUpdate
) -> DeployResultPublic:
    """Change the canary's share of new sessions."""
    with self_audited(request):
        result = deploy.set_canary_weight(
            engine, settings, body.weight, operator.actor, details=operator.details(reason=body.reason)
        )
    return deploy_result("deploy.weight", operator.actor, result)


@router.post("/promote", response_model=DeployResultPublic, name="deploy.promote", responses=DEPLOY_RESPONSES)
def promote(
    operator: Operator, settings: AppSettings, engine: DbEngine, request: Request, body: PromoteRequest | None = None
) -> DeployResultPublic:
    """Promote the canary: its checkpoint becomes stable on every replica."""
    reason = body.reason if body else None
    with self_audited(request):
        result = deploy.promote(engine, settings, operator.actor, details=operator.details(reason=reason))
    return deploy_result("deploy.promote", operator.actor, result)


@router.post("/rollback", response_model=DeployResultPublic, name="deploy.rollback", responses=DEPLOY_RESPONSES)
def rollback(
    operator: Operator, settings: AppSettings, engine: DbEngine, request: Request, body: RollbackRequest | None = None
) -> DeployResultPublic:
    """Roll back: end the canary (back to the previous stable), or serve a given checkpoint as stable."""
    body = body or RollbackRequest()
    with self_audited(request):
        result = deploy.rollback(
            engine,
            settings,
            operator.actor,
            to_checkpoint_id=body.to_checkpoint_id,
            details=operator.details(reason=body.reason),
        )
    return deploy_result("deploy.rollback", operator.actor, result)
