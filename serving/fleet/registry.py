"""The fleet in Postgres: its replicas (``replicas``), its deployments (``deployments``), its lock.

A fleet (``serving.fleet``) is a set of vLLM replicas that serve an active *stable*
deployment and, at times, an active *canary*. :func:`ensure_fleet` registers the replicas
and, for a new fleet, the base checkpoint as its stable deployment; :func:`register_replicas`
does the same and says what it did (``flywheel fleet register`` calls it once, the canary
controller at every look for the replicas ``vllm.urls`` names). :func:`fleet_status` reads it
all back. :func:`fleet_lock` is the per-fleet advisory lock every deployment operation
(:mod:`serving.fleet.deploy`) holds while it runs.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from flywheel.core import vllm_admin
from flywheel.core.db.models import AuditLog, Checkpoint, Deployment, Replica
from flywheel.core.endpoints import vllm_urls
from flywheel.model.register import register_base_model

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from flywheel.core.settings import Settings

log = logging.getLogger(__name__)

LOCK_NAMESPACE = 0x466C_5744
"""First key of the two-key advisory lock of a fleet ('FlWD'); the second is ``hashtext(fleet)``."""
ErrorKind = Literal["not_found", "conflict", "invalid", "failed"]


class DeployError(Exception):
    """A deployment operation refused or failed; ``kind`` maps to HTTP 404/409/422/502 in the admin API.

    ``not_found``, ``conflict`` and ``invalid`` are refusals: nothing changed. ``failed`` means
    a swap failed; the replicas involved were reverted or marked failed (see the message).
    """

    def __init__(self, kind: ErrorKind, message: str):
        self.kind, self.message = kind, message
        super().__init__(f"{kind}: {message}")


# --------------------------------------------------------------------------- views


@dataclass
class DeploymentInfo:
    """A deployment row as the API shows it."""

    id: int
    fleet: str
    checkpoint_id: str
    policy_version: str | None
    role: str
    weight: float
    strategy: str
    status: str
    reason: str | None
    created_by: str | None
    created_at: str | None
    updated_at: str | None
    ended_at: str | None
    agent_role: str | None = None
    """The agent role of a ``pinned`` deployment (None for stable and canary)."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable."""
        return asdict(self)


@dataclass
class ReplicaInfo:
    """A replica row as the API shows it."""

    id: int
    """The row's id: the one name the router's clients and metrics know the replica by
    (``x-flywheel-replica``, ``/ready``, its error messages, the ``replica`` label); ``url`` is internal."""
    url: str
    state: str
    policy_version: str | None
    checkpoint_id: str | None
    deployment_id: int | None
    reason: str | None
    updated_at: str | None

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable."""
        return asdict(self)


@dataclass
class FleetStatus:
    """What a fleet serves: its stable and canary deployments, its role pins and its replicas."""

    fleet: str
    stable: DeploymentInfo | None
    canary: DeploymentInfo | None
    """The active canary, else a pending one (being deployed), else None."""
    replicas: list[ReplicaInfo] = field(default_factory=list)
    pins: list[DeploymentInfo] = field(default_factory=list)
    """Active and pending role pins (:mod:`serving.fleet.pins`), by agent role."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable."""
        return {
            "fleet": self.fleet,
            "stable": self.stable.to_dict() if self.stable else None,
            "canary": self.canary.to_dict() if self.canary else None,
            "replicas": [r.to_dict() for r in self.replicas],
            "pins": [p.to_dict() for p in self.pins],
        }


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def deployment_info(session: Session, row: Deployment) -> DeploymentInfo:
    """The API view of a deployment row (with its checkpoint's policy version)."""
    version = session.scalar(select(Checkpoint.policy_version).where(Checkpoint.id == row.checkpoint_id))
    return DeploymentInfo(
        id=row.id,
        fleet=row.fleet,
        checkpoint_id=row.checkpoint_id,
        policy_version=version,
        role=row.role,
        weight=row.weight,
        strategy=row.strategy,
        status=row.status,
        reason=row.reason,
        created_by=row.created_by,
        created_at=_iso(row.created_at),
        updated_at=_iso(row.updated_at),
        ended_at=_iso(row.ended_at),
        agent_role=row.agent_role or None,
    )


def replica_info(row: Replica) -> ReplicaInfo:
    """The API view of a replica row."""
    return ReplicaInfo(
        id=row.id,
        url=row.url,
        state=row.state,
        policy_version=row.policy_version,
        checkpoint_id=row.checkpoint_id,
        deployment_id=row.deployment_id,
        reason=row.reason,
        updated_at=_iso(row.updated_at),
    )


# --------------------------------------------------------------------------- queries


def active_deployment(session: Session, fleet: str, role: str) -> Deployment | None:
    """The fleet's active deployment of ``role`` (``stable`` or ``canary``)."""
    query = select(Deployment).where(Deployment.fleet == fleet, Deployment.role == role, Deployment.status == "active")
    return session.scalars(query).first()


def active_pins(session: Session, fleet: str) -> list[Deployment]:
    """The fleet's active and pending role pins (role ``pinned``), by agent role."""
    query = (
        select(Deployment)
        .where(Deployment.fleet == fleet, Deployment.role == "pinned", Deployment.status.in_(("active", "pending")))
        .order_by(Deployment.agent_role)
    )
    return list(session.scalars(query))


def fleet_replicas(session: Session, fleet: str) -> list[Replica]:
    """The fleet's replica rows in registration order."""
    return list(session.scalars(select(Replica).where(Replica.fleet == fleet).order_by(Replica.id)))


def checkpoint_of_version(session: Session, version: str | None) -> Checkpoint | None:
    """The checkpoint whose policy version is ``version``."""
    if version is None:
        return None
    return session.scalars(select(Checkpoint).where(Checkpoint.policy_version == version)).first()


def fleet_status(engine: Engine, fleet: str) -> FleetStatus:
    """The fleet's stable and canary deployments and its replicas, read from Postgres."""
    with Session(engine) as session:
        stable = active_deployment(session, fleet, "stable")
        canary = active_deployment(session, fleet, "canary")
        if canary is None:
            canary = session.scalars(
                select(Deployment)
                .where(Deployment.fleet == fleet, Deployment.role == "canary", Deployment.status == "pending")
                .order_by(Deployment.id.desc())
            ).first()
        return FleetStatus(
            fleet=fleet,
            stable=deployment_info(session, stable) if stable else None,
            canary=deployment_info(session, canary) if canary else None,
            replicas=[replica_info(r) for r in fleet_replicas(session, fleet)],
            pins=[deployment_info(session, p) for p in active_pins(session, fleet)],
        )


# --------------------------------------------------------------------------- lock


@contextmanager
def try_fleet_lock(engine: Engine, fleet: str) -> Iterator[bool]:
    """Try the fleet's advisory lock without waiting; yields whether it is held, releases it on exit.

    Session-level lock on a dedicated connection: Postgres drops it when the connection
    ends, so a killed process never leaves it behind.
    """
    conn = engine.connect()
    held = False
    try:
        held = bool(
            conn.execute(
                text("SELECT pg_try_advisory_lock(:ns, hashtext(:fleet))"), {"ns": LOCK_NAMESPACE, "fleet": fleet}
            ).scalar()
        )
        conn.commit()
        yield held
    finally:
        try:
            if held:
                conn.execute(
                    text("SELECT pg_advisory_unlock(:ns, hashtext(:fleet))"), {"ns": LOCK_NAMESPACE, "fleet": fleet}
                )
                conn.commit()
        except Exception:  # a broken connection: discard it so the lock dies with it, then re-raise
            conn.invalidate()
            raise
        finally:
            conn.close()


@contextmanager
def fleet_lock(engine: Engine, fleet: str) -> Iterator[None]:
    """Hold the fleet's lock for a deployment operation; :class:`DeployError` ``conflict`` when taken."""
    with try_fleet_lock(engine, fleet) as held:
        if not held:
            raise DeployError("conflict", f"another deployment operation is running on fleet {fleet!r}")
        yield


# --------------------------------------------------------------------------- registration


def _reported_version(url: str) -> tuple[str | None, str | None]:
    """``(weight version, None)`` of a healthy replica, else ``(None, why not)``."""
    if not vllm_admin.health(url):
        return None, f"{url}/health did not answer 200 at registration"
    try:
        return vllm_admin.weight_info(url), None
    except vllm_admin.VllmAdminError as err:
        return None, f"/weight_info failed at registration: {err}"


@dataclass
class Registration:
    """What one registration did: whether it held the fleet lock, the rows it added or adopted."""

    fleet: str
    locked_out: bool
    """Another deployment operation held the fleet lock: nothing was written."""
    stable_created: bool = False
    added: list[dict[str, Any]] = field(default_factory=list)
    """Replicas seen for the first time (``url``, ``state``, ``policy_version``, ``checkpoint_id``, ``reason``)."""
    adopted: list[dict[str, Any]] = field(default_factory=list)
    """Replicas registered ``failed`` earlier (never healthy since) that answer now."""


def ensure_fleet(
    engine: Engine,
    settings: Settings,
    urls: list[str] | None = None,
    model_dir: Path | str | None = None,
    actor: str = "serving",
    build: bool = True,
) -> FleetStatus:
    """Register the fleet's replicas and, when the fleet has no stable deployment, the base as stable.

    ``urls`` default to :func:`flywheel.core.endpoints.vllm_urls`; each new replica is
    recorded with the version its ``/weight_info`` reports (``failed`` when it does not
    answer). A replica recorded ``failed`` at registration that never served since (no
    checkpoint) is probed again and, when it answers now, recorded as a new one would be: a
    replica that joins late is routed once healthy. A fleet without an active stable
    deployment gets the base checkpoint (:func:`flywheel.model.register.register_base_model`
    of ``model_dir``, default: the base model ``settings.model`` selects, built when missing
    and ``build``) as one, weight 1.0. Idempotent; rows of other known replicas are left to
    :func:`serving.fleet.deploy.reconcile`. While another deployment operation holds the fleet
    lock nothing is written (that operation owns the fleet) and the status is returned.
    """
    register_replicas(engine, settings, urls, model_dir, actor, build)
    return fleet_status(engine, settings.serving.fleet)


def register_replicas(
    engine: Engine,
    settings: Settings,
    urls: list[str] | None = None,
    model_dir: Path | str | None = None,
    actor: str = "serving",
    build: bool = True,
) -> Registration:
    """:func:`ensure_fleet`'s work, answering what it did (:class:`Registration`) instead of the status."""
    fleet = settings.serving.fleet
    urls = [u.rstrip("/") for u in (urls if urls is not None else vllm_urls(settings))]
    with try_fleet_lock(engine, fleet) as held:
        if not held:
            log.info("fleet %s is locked by another deployment operation; registration skipped", fleet)
            return Registration(fleet=fleet, locked_out=True)
        return _register(engine, settings, urls, model_dir, actor, build)


def _probe(session: Session, url: str, stable: Deployment) -> dict[str, Any]:
    """A replica row's columns from what ``url`` answers now."""
    version, why = _reported_version(url)
    checkpoint = checkpoint_of_version(session, version)
    checkpoint_id = checkpoint.id if checkpoint else None
    return {
        "state": "serving" if why is None else "failed",
        "policy_version": version,
        "checkpoint_id": checkpoint_id,
        "deployment_id": stable.id if checkpoint_id == stable.checkpoint_id else None,
        "reason": why,
    }


def _never_served(row: Replica) -> bool:
    """Recorded ``failed`` and never bound to a checkpoint since: unreachable when it was registered."""
    return row.state == "failed" and row.checkpoint_id is None and row.deployment_id is None


def _register(
    engine: Engine, settings: Settings, urls: list[str], model_dir: Path | str | None, actor: str, build: bool
) -> Registration:
    fleet = settings.serving.fleet
    result = Registration(fleet=fleet, locked_out=False)
    with Session(engine) as session:
        stable = active_deployment(session, fleet, "stable")
        if stable is None:
            base_id = register_base_model(session, settings.model, model_dir, build=build)
            stable = Deployment(
                fleet=fleet,
                checkpoint_id=base_id,
                role="stable",
                weight=1.0,
                strategy=settings.serving.strategy,
                status="active",
                reason="base model: the fleet's first stable deployment",
                created_by=actor,
            )
            session.add(stable)
            session.flush()
            result.stable_created = True
        known = {r.url: r for r in session.scalars(select(Replica).where(Replica.url.in_(urls)))}
        for url in urls:
            row = known.get(url)
            if row is not None and row.fleet != fleet:
                raise DeployError("conflict", f"replica {url} is registered in fleet {row.fleet!r}, not {fleet!r}")
            if row is None:
                values = _probe(session, url, stable)
                session.add(Replica(fleet=fleet, url=url, **values))
                result.added.append({"url": url, **values})
            elif _never_served(row):
                values = _probe(session, url, stable)
                if values["state"] == "failed":
                    continue  # still unreachable: the row keeps its first reason
                for name, value in values.items():
                    setattr(row, name, value)
                row.updated_at = func.now()
                result.adopted.append({"url": url, **values})
        if result.stable_created or result.added or result.adopted:
            added = [{k: r[k] for k in ("url", "policy_version", "checkpoint_id", "reason")} for r in result.added]
            session.add(
                AuditLog(
                    actor=actor,
                    action="fleet.register",
                    target=f"fleet:{fleet}",
                    before=None,
                    after={"stable_deployment_id": stable.id, "stable_checkpoint_id": stable.checkpoint_id},
                    details={
                        "replicas_added": added,
                        "replicas_adopted": [r["url"] for r in result.adopted],
                        "stable_created": result.stable_created,
                    },
                    success=True,
                )
            )
        session.commit()
    return result


def set_replica(engine: Engine, url: str, **values: Any) -> None:
    """Update a replica row's columns (``updated_at`` set to now); commits at once."""
    with Session(engine) as session:
        row = session.scalars(select(Replica).where(Replica.url == url)).one()
        for name, value in values.items():
            setattr(row, name, value)
        row.updated_at = func.now()
        session.commit()
