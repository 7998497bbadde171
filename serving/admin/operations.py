"""Deployment operations: the admin API's long actions, run in the background and followed by id.

``POST /v1/canary``, ``PUT /v1/canary/weight``, ``POST /v1/promote`` and ``POST /v1/rollback``
refuse at once (4xx) what can be known up front: an invalid body, an unknown or unusable
checkpoint, no canary to promote, no stable, another operation on the fleet. Otherwise they
record an *operation* (table ``operations``), answer ``202 Accepted`` with it (``Location:
/v1/operations/{id}``), and a thread of this process (:class:`OperationRunner`) runs the
``serving.fleet.deploy`` function, which holds the fleet's lock and writes the audit row as
before. An operation is ``queued``, then ``running``, then ``succeeded`` (with the result)
or ``failed`` (with ``error`` and ``reason``). ``GET /v1/operations/{id}`` answers from
Postgres, so every admin API process answers for every other and an operation outlives a
restart. With ``?wait=true`` the request is held until the operation ends (at most
``serving.operation_wait_s``, or ``wait_s``) and answers 200 with it, or the error's own
status (404, 409, 422, 502) and reason with ``operation_id``: the synchronous behaviour.

At most one operation per fleet is queued or running (a partial unique index): a second one
is refused with 409 naming the first.

Leases. The process that accepted an operation (its ``owner``: host, pid and a nonce) renews
``heartbeat_at`` every third of ``serving.operation_lease_s`` while the operation is queued
or running; the lease is recorded on the row (``lease_s``). Any admin API process marks an
operation whose lease has lapsed ``failed`` with ``error = 'abandoned'`` and the reason
(:func:`expire_abandoned`): at its start, before it accepts an operation, and whenever an
operation is read. So an operation left ``running`` by a process that died (killed, out of
memory, its machine gone) ends within one lease of its death, as soon as any admin API
process runs, and a process that starts never mistakes a live peer's operation for a dead
one (its lease is fresh). Time is the database's (``now()``), never a host clock. An owner
that was cut off from the database past its lease and then finishes writes the real outcome
over the ``abandoned`` mark. The fleet's advisory lock dies with the dead process's
connection, so the next operation can run; the fleet may be part-way through the change
(a ``pending`` deployment, a replica ``draining`` or ``swapping``), which the abandoned
reason says (the canary controller's reconcile returns replicas to their deployments).

Stopping: a process that shuts down refuses new operations (503), fails those still queued,
and lets the running one finish (a swap cut half-way would leave a replica paused).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from sqlalchemy import Engine, func, select, update
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session

from flywheel.core.db.models import OPERATION_ACTIVE, Operation
from serving.admin.errors import AdminError
from serving.fleet.registry import DeployError, try_fleet_lock

log = logging.getLogger(__name__)

Work = Callable[[uuid.UUID], dict[str, Any]]
"""What an operation runs, given its id: a ``serving.fleet.deploy`` call returning the result to record."""
FINISH_RETRY_S = 1.0
"""Pause between tries to record an operation's end while the database does not answer."""


def owner_id() -> str:
    """This process's name on the operations it runs: ``host:pid:nonce`` (a container restarted keeps host and pid)."""
    return f"{socket.gethostname()[:96]}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


# --------------------------------------------------------------------------- the table


def get_operation(engine: Engine, operation_id: uuid.UUID) -> Operation | None:
    """The operation row (abandoned ones marked first), or None."""
    expire_abandoned(engine)
    with Session(engine, expire_on_commit=False) as session:
        return session.get(Operation, operation_id)


def list_operations(
    engine: Engine,
    *,
    limit: int,
    fleet: str | None = None,
    state: str | None = None,
    kind: str | None = None,
) -> list[Operation]:
    """Operations, newest first, filtered (abandoned ones marked first)."""
    expire_abandoned(engine)
    query = select(Operation).order_by(Operation.created_at.desc(), Operation.id).limit(limit)
    for column, value in ((Operation.fleet, fleet), (Operation.state, state), (Operation.kind, kind)):
        if value is not None:
            query = query.where(column == value)
    with Session(engine, expire_on_commit=False) as session:
        return list(session.scalars(query))


def active_operation(session: Session, fleet: str) -> Operation | None:
    """The fleet's queued or running operation, if any."""
    query = select(Operation).where(Operation.fleet == fleet, Operation.state.in_(OPERATION_ACTIVE))
    return session.scalars(query).first()


def abandoned_reason(row: Operation) -> str:
    """Why an operation whose lease lapsed is failed, and what to look at."""
    renewed = f"{row.heartbeat_at:%Y-%m-%d %H:%M:%S %Z}".strip()
    return (
        f"abandoned: admin API process {row.owner} stopped renewing this {row.state} operation's lease "
        f"(last renewed {renewed}, lease {row.lease_s:g} s): it died, was killed or lost the database. "
        "The fleet may be part-way through the change: check `flywheel status` and `flywheel audit --prefix deploy.` "
        "(the canary controller's reconcile returns replicas to their deployments)"
    )


def expire_abandoned(engine: Engine) -> list[Operation]:
    """Mark every queued or running operation whose lease has lapsed ``failed`` (``abandoned``); returns them."""
    lapsed = Operation.heartbeat_at + func.make_interval(0, 0, 0, 0, 0, 0, Operation.lease_s) < func.now()
    query = (
        select(Operation)
        .where(Operation.state.in_(OPERATION_ACTIVE), lapsed)
        .with_for_update(skip_locked=True)
        .order_by(Operation.created_at)
    )
    with Session(engine, expire_on_commit=False) as session:
        rows = list(session.scalars(query))
        for row in rows:
            row.reason = abandoned_reason(row)
            row.state, row.error, row.finished_at = "failed", "abandoned", func.now()
            log.warning("operation %s (%s on fleet %s) %s", row.id, row.kind, row.fleet, row.reason)
        session.commit()
    return rows


def busy_reason(row: Operation) -> str:
    """The 409 of a second operation while ``row`` is queued or running."""
    return (
        f"operation {row.id} ({row.kind} by {row.actor}) is {row.state} on fleet {row.fleet!r}: one deployment "
        f"operation per fleet at a time; follow it with `flywheel ops show {row.id} --wait`"
    )


# --------------------------------------------------------------------------- the runner


class OperationRunner:
    """Runs the operations this admin API process accepted, and renews their leases.

    Threads start with the first operation: a thread pool for the work, and a heartbeat
    thread that renews the leases while any operation of this process is queued or running
    (and stops when none is).
    """

    def __init__(self, engine: Engine, lease_s: float, *, workers: int = 2):
        self.engine = engine
        self.lease_s = lease_s
        self.owner = owner_id()
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="flywheel-operation")
        self._lock = threading.Lock()
        self._futures: dict[uuid.UUID, Future[None]] = {}
        self._done: dict[uuid.UUID, threading.Event] = {}
        self._heartbeat: threading.Thread | None = None
        self._accepting = True
        self._stopped = threading.Event()

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """At the admin API's start: mark operations abandoned by dead processes (the database may be down)."""
        try:
            for row in expire_abandoned(self.engine):
                log.info("operation %s of %s marked failed at start: abandoned", row.id, row.owner)
        except SQLAlchemyError as err:  # retried before every operation and every read
            log.warning("could not look for abandoned operations at start (database unavailable?): %s", err)

    def close(self) -> None:
        """Refuse new operations, fail the queued ones, wait for the running ones, then stop renewing leases."""
        with self._lock:
            self._accepting = False
            pending = [(op_id, f) for op_id, f in self._futures.items() if f.cancel()]
        for op_id, _ in pending:
            self._finish(op_id, "failed", error="abandoned", reason="the admin API process stopped before it started")
            self._release(op_id)
        running = len(self._futures)
        if running:
            log.info("admin API stopping: waiting for %d running operation(s) to finish", running)
        self._executor.shutdown(wait=True)
        self._stopped.set()

    # ---------------------------------------------------------------- submit and wait

    def submit(self, fleet: str, kind: str, actor: str, params: dict[str, Any], work: Work) -> Operation:
        """Record a queued operation and run ``work`` in the background; 409 while the fleet is busy.

        Refused with :class:`DeployError` ``conflict`` while another operation of the fleet is
        queued or running, or another process (the canary controller, a reconcile, a
        registration) holds the fleet's lock; 503 while this process stops.
        """
        if not self._accepting:
            raise AdminError(503, "the admin API is stopping; send the request again (to another admin API process)")
        expire_abandoned(self.engine)
        op_id = uuid.uuid4()
        with Session(self.engine, expire_on_commit=False) as session:
            running = active_operation(session, fleet)
            if running is not None:
                raise DeployError("conflict", busy_reason(running))
            with try_fleet_lock(self.engine, fleet) as free:
                if not free:
                    raise DeployError(
                        "conflict",
                        f"another deployment operation is running on fleet {fleet!r} (the canary controller, a "
                        "reconcile or a fleet registration holds its lock); retry in a moment",
                    )
            row = Operation(
                id=op_id,
                fleet=fleet,
                kind=kind,
                state="queued",
                actor=actor,
                params=params,
                owner=self.owner,
                lease_s=self.lease_s,
            )
            session.add(row)
            try:
                session.commit()
            except IntegrityError:  # another request won the fleet's one active operation meanwhile
                session.rollback()
                running = active_operation(session, fleet)
                reason = busy_reason(running) if running else f"another operation was accepted on fleet {fleet!r}"
                raise DeployError("conflict", reason) from None
            session.refresh(row)
        with self._lock:
            self._done[op_id] = threading.Event()
            self._futures[op_id] = self._executor.submit(self._run, op_id, work)
            self._ensure_heartbeat()
        log.info("operation %s accepted: %s on fleet %s by %s %s", op_id, kind, fleet, actor, params)
        return row

    def wait(self, operation_id: uuid.UUID, timeout_s: float) -> bool:
        """Wait until this process's operation ends (or ``timeout_s``); whether it ended."""
        with self._lock:
            event = self._done.get(operation_id)
        return True if event is None else event.wait(timeout_s)

    # ---------------------------------------------------------------- the work

    def _run(self, op_id: uuid.UUID, work: Work) -> None:
        try:
            if not self._begin(op_id):
                return
            try:
                result = work(op_id)
            except DeployError as err:
                self._finish(op_id, "failed", error=err.kind, reason=err.message)
            except Exception as err:  # unexpected: the operation fails with it (the traceback is in the log)
                log.exception("operation %s failed unexpectedly", op_id)
                self._finish(op_id, "failed", error="internal", reason=f"internal error: {type(err).__name__}: {err}")
            else:
                self._finish(op_id, "succeeded", result=result)
        finally:
            self._release(op_id)

    def _begin(self, op_id: uuid.UUID) -> bool:
        """Queued → running; False when the row is no longer this process's queued operation."""
        with Session(self.engine) as session:
            started = session.execute(
                update(Operation)
                .where(Operation.id == op_id, Operation.owner == self.owner, Operation.state == "queued")
                .values(state="running", started_at=func.now(), heartbeat_at=func.now())
            ).rowcount
            session.commit()
        if not started:
            log.warning("operation %s was no longer queued by this process: not run", op_id)
        return bool(started)

    def _finish(
        self,
        op_id: uuid.UUID,
        state: str,
        *,
        result: dict[str, Any] | None = None,
        error: str | None = None,
        reason: str | None = None,
    ) -> None:
        """Record the end, retrying while the database does not answer (up to one lease)."""
        values = {"state": state, "finished_at": func.now(), "result": result, "error": error, "reason": reason}
        deadline = time.monotonic() + self.lease_s
        while True:
            try:
                with Session(self.engine) as session:
                    previous = session.scalar(select(Operation.error).where(Operation.id == op_id))
                    session.execute(
                        update(Operation).where(Operation.id == op_id, Operation.owner == self.owner).values(**values)
                    )
                    session.commit()
            except SQLAlchemyError as err:
                if time.monotonic() > deadline:
                    log.error("could not record the end of operation %s (%s): %s", op_id, state, err)
                    raise
                time.sleep(FINISH_RETRY_S)
                continue
            if previous == "abandoned":
                log.warning("operation %s had been marked abandoned; its owner recorded the real end: %s", op_id, state)
            log.info("operation %s %s%s", op_id, state, f": {error}: {reason}" if error else "")
            return

    def _release(self, op_id: uuid.UUID) -> None:
        with self._lock:
            self._futures.pop(op_id, None)
            event = self._done.pop(op_id, None)
        if event is not None:
            event.set()

    # ---------------------------------------------------------------- leases

    def _ensure_heartbeat(self) -> None:
        """Start the heartbeat thread if it is not running (called with ``_lock`` held)."""
        if self._heartbeat is None or not self._heartbeat.is_alive():
            self._heartbeat = threading.Thread(target=self._beat, name="flywheel-operation-lease", daemon=True)
            self._heartbeat.start()

    def _beat(self) -> None:
        interval = self.lease_s / 3.0
        while not self._stopped.wait(interval):
            with self._lock:
                if not self._futures:
                    self._heartbeat = None
                    return
            try:
                with Session(self.engine) as session:
                    session.execute(
                        update(Operation)
                        .where(Operation.owner == self.owner, Operation.state.in_(OPERATION_ACTIVE))
                        .values(heartbeat_at=func.now())
                    )
                    session.commit()
            except SQLAlchemyError as err:  # retried at the next beat; past the lease the operations are abandoned
                log.warning(
                    "could not renew the lease of this process's operations (next try in %.1f s): %s", interval, err
                )
