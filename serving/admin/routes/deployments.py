"""Deployment operations (operator): deploy a canary, change its weight, promote, roll back, pin an agent role.

Each refuses at once (4xx) what its ``serving.fleet.deploy.check_*`` function finds wrong
now (unknown or unusable checkpoint, no canary, no stable, a canary already active) and
what the fleet's state forbids (another operation queued or running, the fleet's lock
held), with an audit row like the deployment function's own refusals. Otherwise it answers
``202 Accepted`` with an operation that a thread of this process runs
(:mod:`serving.admin.operations`): the ``serving.fleet.deploy`` function, which holds the
fleet's lock, runs the swaps and writes the audit row under the token's name, with the
operation's id in its details.

``?wait=true`` holds the request until the operation ends (at most ``wait_s`` seconds,
default ``serving.operation_wait_s``) and answers ``200`` with the succeeded
operation, or the failure's status (404, 409, 422, 502) and reason with its
``operation_id``; still running by then, ``202`` with the operation as it is.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request, Response

from serving.admin.audit import mark_audited, write_audit
from serving.admin.deps import AppSettings, DbEngine, Operator, Principal
from serving.admin.errors import DEPLOY_RESPONSES, ERROR_RESPONSES, OPERATION_ERROR_STATUS, AdminError
from serving.admin.operations import OperationRunner, get_operation
from serving.admin.schemas import (
    CanaryCreate,
    OperationPublic,
    PinCreate,
    PromoteRequest,
    RollbackRequest,
    WeightUpdate,
    deploy_result,
    operation_public,
)
from serving.fleet import deploy, pins
from serving.fleet.registry import DeployError, fleet_status

router = APIRouter(prefix="/v1", responses=ERROR_RESPONSES)

Wait = Annotated[
    bool,
    Query(
        description="Hold the request until the operation ends and answer 200 with it, or the failure's own "
        "status and reason (404, 409, 422, 502); still running after the wait, 202."
    ),
]
AgentRole = Annotated[
    str,
    Path(
        min_length=1,
        max_length=64,
        pattern=r"^[A-Za-z0-9._-]+$",
        description="The agent role, as the SDK sends it in x-flywheel-agent-role.",
    ),
]
WaitS = Annotated[
    float | None,
    Query(gt=0, le=7200, description="With wait: the longest wait in seconds (default serving.operation_wait_s)."),
]
RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"model": OperationPublic, "description": "With ?wait=true: the operation ended and succeeded."},
    202: {"model": OperationPublic, "description": "Accepted: the operation (follow it at the Location header)."},
    **DEPLOY_RESPONSES,
}


def start_operation(
    request: Request,
    response: Response,
    operator: Principal,
    kind: str,
    params: dict[str, Any],
    check: Callable[[], None],
    work: Callable[[dict[str, Any]], dict[str, Any]],
    wait: bool,
    wait_s: float | None,
    audit_info: dict[str, Any] | None = None,
) -> OperationPublic:
    """``check`` the request, submit ``work`` (given the audit details) as an operation; answer it, or wait.

    A refusal of ``check`` or of the submission (another operation, the fleet's lock) is
    audited as the deployment function audits its own: ``audit_info`` and the token's
    details, the error and its message, the fleet before.
    """
    settings = request.app.state.settings
    engine = request.app.state.engine
    runner: OperationRunner = request.app.state.operations
    fleet = settings.serving.fleet
    reason = params.get("reason")

    def run(operation_id: uuid.UUID) -> dict[str, Any]:
        result = work(operator.details(reason=reason, operation_id=str(operation_id)))
        return deploy_result(kind, operator.actor, result).model_dump(mode="json")

    try:
        check()
        row = runner.submit(fleet, kind, operator.actor, params, run)
    except DeployError as err:
        details = {**(audit_info or {}), **operator.details(reason=reason), "error": err.kind, "message": err.message}
        before = fleet_status(engine, fleet).to_dict()
        write_audit(engine, actor=operator.actor, action=kind, target=f"fleet:{fleet}", before=before, details=details,
                    success=False)  # fmt: skip
        mark_audited(request)
        raise
    response.headers["Location"] = f"/v1/operations/{row.id}"
    if wait:
        runner.wait(row.id, wait_s or settings.serving.operation_wait_s)
        row = get_operation(request.app.state.engine, row.id) or row
        if row.state == "succeeded":
            response.status_code = 200
        elif row.state == "failed":
            mark_audited(request)  # the deployment function wrote the audit row of the failure
            status = OPERATION_ERROR_STATUS.get(row.error or "", 502)
            raise AdminError(status, row.reason or "failed", kind=row.error, operation_id=str(row.id))
    return operation_public(row)


@router.post("/canary", status_code=202, response_model=OperationPublic, name="deploy.canary", responses=RESPONSES)
def deploy_canary(
    operator: Operator,
    settings: AppSettings,
    engine: DbEngine,
    request: Request,
    response: Response,
    body: CanaryCreate,
    wait: Wait = False,
    wait_s: WaitS = None,
) -> OperationPublic:
    """Deploy a checkpoint as the fleet's canary with a traffic weight (hot swap, one replica at a time)."""
    return start_operation(
        request,
        response,
        operator,
        "deploy.canary",
        body.model_dump(),
        lambda: deploy.check_canary(engine, settings, body.checkpoint_id, body.weight),
        lambda details: deploy.deploy_canary(
            engine, settings, body.checkpoint_id, body.weight, operator.actor, details=details
        ),
        wait,
        wait_s,
        {**body.model_dump(), "strategy": settings.serving.strategy},
    )


@router.put(
    "/canary/weight", status_code=202, response_model=OperationPublic, name="deploy.weight", responses=RESPONSES
)
def set_weight(
    operator: Operator,
    settings: AppSettings,
    engine: DbEngine,
    request: Request,
    response: Response,
    body: WeightUpdate,
    wait: Wait = False,
    wait_s: WaitS = None,
) -> OperationPublic:
    """Change the canary's share of new sessions."""
    return start_operation(
        request,
        response,
        operator,
        "deploy.weight",
        body.model_dump(),
        lambda: deploy.check_weight(engine, settings, body.weight),
        lambda details: deploy.set_canary_weight(engine, settings, body.weight, operator.actor, details=details),
        wait,
        wait_s,
        {"weight": body.weight},
    )


@router.post("/promote", status_code=202, response_model=OperationPublic, name="deploy.promote", responses=RESPONSES)
def promote(
    operator: Operator,
    settings: AppSettings,
    engine: DbEngine,
    request: Request,
    response: Response,
    body: PromoteRequest | None = None,
    wait: Wait = False,
    wait_s: WaitS = None,
) -> OperationPublic:
    """Promote the canary: its checkpoint becomes stable on every replica."""
    body = body or PromoteRequest()
    return start_operation(
        request,
        response,
        operator,
        "deploy.promote",
        body.model_dump(),
        lambda: deploy.check_promote(engine, settings),
        lambda details: deploy.promote(engine, settings, operator.actor, details=details),
        wait,
        wait_s,
    )


@router.post("/rollback", status_code=202, response_model=OperationPublic, name="deploy.rollback", responses=RESPONSES)
def rollback(
    operator: Operator,
    settings: AppSettings,
    engine: DbEngine,
    request: Request,
    response: Response,
    body: RollbackRequest | None = None,
    wait: Wait = False,
    wait_s: WaitS = None,
) -> OperationPublic:
    """Roll back: end the canary (back to the previous stable), or serve a given checkpoint as stable."""
    body = body or RollbackRequest()
    return start_operation(
        request,
        response,
        operator,
        "deploy.rollback",
        body.model_dump(),
        lambda: deploy.check_rollback(engine, settings, body.to_checkpoint_id),
        lambda details: deploy.rollback(
            engine, settings, operator.actor, to_checkpoint_id=body.to_checkpoint_id, details=details
        ),
        wait,
        wait_s,
        {"to_checkpoint_id": body.to_checkpoint_id},
    )


@router.put(
    "/pins/{agent_role}", status_code=202, response_model=OperationPublic, name="deploy.pin", responses=RESPONSES
)
def pin_role(
    operator: Operator,
    settings: AppSettings,
    engine: DbEngine,
    request: Request,
    response: Response,
    agent_role: AgentRole,
    body: PinCreate,
    wait: Wait = False,
    wait_s: WaitS = None,
) -> OperationPublic:
    """Pin an agent role to a checkpoint: its requests go to that checkpoint whatever stable and canary do
    (PARL's frozen sub-agents). A pinned role already pinned moves to the new checkpoint."""
    info = {"agent_role": agent_role, "checkpoint": body.checkpoint_id, "strategy": settings.serving.strategy}
    return start_operation(
        request,
        response,
        operator,
        "deploy.pin",
        {"agent_role": agent_role, **body.model_dump()},
        lambda: pins.check_pin(engine, settings, agent_role, body.checkpoint_id, operator.actor),
        lambda details: pins.pin_role(engine, settings, agent_role, body.checkpoint_id, operator.actor, details),
        wait,
        wait_s,
        info,
    )


@router.delete(
    "/pins/{agent_role}", status_code=202, response_model=OperationPublic, name="deploy.unpin", responses=RESPONSES
)
def unpin_role(
    operator: Operator,
    settings: AppSettings,
    engine: DbEngine,
    request: Request,
    response: Response,
    agent_role: AgentRole,
    wait: Wait = False,
    wait_s: WaitS = None,
) -> OperationPublic:
    """End an agent role's pin: its requests follow stable and canary again."""
    return start_operation(
        request,
        response,
        operator,
        "deploy.unpin",
        {"agent_role": agent_role},
        lambda: pins.check_unpin(engine, settings, agent_role, operator.actor),
        lambda details: pins.unpin_role(engine, settings, agent_role, operator.actor, details),
        wait,
        wait_s,
        {"agent_role": agent_role},
    )
