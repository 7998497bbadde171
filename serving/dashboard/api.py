"""The data behind the ops dashboard (``GET /v1/dashboard``), read from Postgres and the broker.

One call returns everything the page draws, so every panel shows the same moment:

- ``checkpoints``: every checkpoint in creation order with its parent (lineage), status,
  held-out success and live reward/success per policy version (:func:`serving.overview.snapshot`);
- ``stable`` / ``canary`` / ``replicas`` / ``traffic``: the fleet's deployments
  (:func:`serving.fleet.registry.fleet_status`) and the share of new sessions each gets (the router
  sends ``canary.weight`` of new sessions to an *active* canary, the rest to stable);
- ``canary_comparison``: the canary controller's newest ``canary.decision`` audit row
  (``details`` as :meth:`serving.canary.policy.Decision.to_details` wrote it: estimate of
  ``canary - stable`` with its always-valid bounds, the margin that applied) next to the
  configured margins, plus the decisions' history for the current canary;
- ``lag``: the pipeline's backlog at three stages (:func:`kafka_lag`, :func:`rewarding_lag`,
  :func:`trainer_lag`); a stage that cannot be measured is ``value: null`` with a ``reason``.

Nothing here writes.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict
from datetime import datetime
from typing import TYPE_CHECKING, Any

from kafka import TopicPartition
from sqlalchemy import text
from sqlalchemy.orm import Session

from flywheel.core import kafka_clients
from flywheel.core.contracts.topics import events_topic
from flywheel.core.endpoints import kafka_bootstrap
from flywheel.core.kafka_ends import fetched_ends
from flywheel.core.pause import pause_state
from serving.canary.controller import canary_pause_state
from serving.fleet.registry import fleet_status
from serving.overview import snapshot

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection, Engine

    from flywheel.core.settings import Settings

log = logging.getLogger(__name__)

KAFKA_TIMEOUT_S = 2.0
"""Longest one dashboard call waits for the broker (the answer is then ``null`` with a reason)."""
KAFKA_CACHE_S = 4.0
"""A Kafka lag measurement is reused this long (the page refreshes every few seconds)."""
KAFKA_FAILURE_CACHE_S = 15.0
"""A failed measurement (broker unreachable) is reused this long: fewer waits and fewer client error logs."""
HISTORY_LIMIT = 200
"""Most canary decisions returned for the current canary's history."""
EVENTS_LIMIT = 15
"""Most recent deployment audit entries returned."""


# --------------------------------------------------------------------------- lag


def _lag(value: int | None, unit: str, reason: str | None = None, **extra: Any) -> dict[str, Any]:
    """One stage's backlog: ``value`` (None when unknown) in ``unit``, why it is unknown, more numbers."""
    return {"value": value, "unit": unit, "reason": reason, **extra}


def measure_kafka_lag(settings: Settings, timeout_s: float = KAFKA_TIMEOUT_S) -> dict[str, Any]:
    """Records on the events topic not yet committed by the ingest consumer group (blocking).

    Committed offsets of ``settings.ingest.group_id`` against the end offsets of the
    ``<prefix>.events`` topic (read by a fetch: ListOffsets is wrong on Tansu, see
    :mod:`flywheel.core.kafka_ends`); a partition the group never committed counts from its
    beginning offset. Raises on any broker error (the caller turns it into a reason).
    """
    bootstrap = kafka_bootstrap(settings).split(",")
    topic = events_topic(settings.kafka.topic_prefix)
    group = settings.ingest.group_id
    timeout_ms = int(timeout_s * 600)  # each client gives up well within the caller's cap
    security = settings.kafka.security()
    common = {
        "security": security,
        "request_timeout_ms": max(timeout_ms, 1000),
        "bootstrap_timeout_ms": timeout_ms,
        "client_id": "flywheel-dashboard",
    }
    admin = kafka_clients.admin(bootstrap, **common)
    try:
        consumer = kafka_clients.consumer(bootstrap, **common, group_id=None, enable_auto_commit=False)
    except Exception:
        admin.close()
        raise
    try:
        partitions = consumer.partitions_for_topic(topic)
        if not partitions:
            return _lag(
                None, "records", f"topic {topic} does not exist on {','.join(bootstrap)}", topic=topic, group=group
            )
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        ends = fetched_ends(
            bootstrap, consumer.end_offsets(tps), timeout_s * 0.6, security=security, client_id="flywheel-dashboard"
        )
        begins = consumer.beginning_offsets(tps)
        committed = {
            tp: meta.offset
            for tp, meta in _group_offsets(admin, group, tps).items()
            if tp.topic == topic and meta is not None and meta.offset is not None and meta.offset >= 0
        }
        per = {tp.partition: max(0, ends[tp] - committed.get(tp, begins[tp])) for tp in tps}
        return _lag(
            sum(per.values()),
            "records",
            None,
            topic=topic,
            group=group,
            partitions={str(p): n for p, n in per.items()},
            uncommitted_partitions=sorted(tp.partition for tp in tps if tp not in committed),
        )
    finally:
        consumer.close()
        admin.close()


def _group_offsets(admin: Any, group: str, tps: list[Any]) -> dict[Any, Any]:
    """Committed offsets of ``group`` on ``tps`` (kafka-python 3's ``list_group_offsets``, else 2's name)."""
    if hasattr(admin, "list_group_offsets"):
        return admin.list_group_offsets({group: tps}).get(group, {})
    return admin.list_consumer_group_offsets(group, partitions=tps)


class KafkaLagProbe:
    """:func:`measure_kafka_lag` with a time cap per call, one measurement at a time, and a short cache.

    A broker that does not answer never holds a dashboard call longer than ``timeout_s``:
    the measurement keeps running in its own thread and a later call picks up its result.
    """

    def __init__(
        self,
        settings: Settings,
        timeout_s: float = KAFKA_TIMEOUT_S,
        cache_s: float = KAFKA_CACHE_S,
        failure_cache_s: float = KAFKA_FAILURE_CACHE_S,
    ):
        self.settings, self.timeout_s, self.cache_s, self.failure_cache_s = (
            settings,
            timeout_s,
            cache_s,
            failure_cache_s,
        )
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dashboard-kafka")
        self._future: Future[dict[str, Any]] | None = None
        self._value: dict[str, Any] | None = None
        self._at = 0.0

    def _measure(self) -> dict[str, Any]:
        try:
            return measure_kafka_lag(self.settings, self.timeout_s)
        except Exception as err:  # broker down, not configured, protocol error: all end as a reason
            name = type(err).__name__
            reason = str(err).strip().splitlines()[0] if str(err).strip() else name
            reason = reason if reason.startswith(name) else f"{name}: {reason}"
            return _lag(None, "records", f"broker unreachable: {reason}")

    def get(self) -> dict[str, Any]:
        """The newest measurement (at most ``cache_s`` old, a failed one ``failure_cache_s``), else a fresh
        one within ``timeout_s``."""
        with self._lock:
            if self._value is not None:
                keep = self.cache_s if self._value["value"] is not None else self.failure_cache_s
                if time.monotonic() - self._at < keep:
                    return self._value
            if self._future is None:
                self._future = self._executor.submit(self._measure)
            future = self._future
        try:
            value = future.result(timeout=self.timeout_s)
        except FutureTimeout:
            return _lag(None, "records", f"broker did not answer within {self.timeout_s:.0f} s")
        with self._lock:
            if self._future is future:
                self._future, self._value, self._at = None, value, time.monotonic()
        return value

    def close(self) -> None:
        """Stop the measuring thread (a running measurement finishes on its own)."""
        self._executor.shutdown(wait=False, cancel_futures=True)


def rewarding_lag(conn: Connection, settings: Settings) -> dict[str, Any]:
    """Sessions that ended longer ago than the feedback window and still have no reward."""
    window = float(settings.rewarding.feedback_window_s)
    row = (
        conn.execute(
            text(
                "SELECT count(*) AS n, "
                "EXTRACT(EPOCH FROM now() - min(s.ended_at)) - :window AS oldest_overdue_s "
                "FROM sessions s WHERE s.ended_at IS NOT NULL "
                "AND s.ended_at < now() - make_interval(secs => :window) "
                "AND NOT EXISTS (SELECT 1 FROM rewards r WHERE r.project = s.project AND r.session_id = s.session_id)"
            ),
            {"window": window},
        )
        .mappings()
        .one()
    )
    overdue = row["oldest_overdue_s"]
    return _lag(
        int(row["n"]),
        "sessions",
        None,
        feedback_window_s=window,
        oldest_overdue_s=round(float(overdue), 1) if overdue is not None else None,
    )


def trainer_lag(conn: Connection) -> dict[str, Any]:
    """Scored samples newer than the newest trained checkpoint's data window, and that checkpoint's age."""
    last = (
        conn.execute(
            text(
                "SELECT id, policy_version, data_window_end, EXTRACT(EPOCH FROM now() - created_at) AS age_s "
                "FROM checkpoints WHERE data_window_end IS NOT NULL ORDER BY created_at DESC, id DESC LIMIT 1"
            )
        )
        .mappings()
        .first()
    )
    since = last["data_window_end"] if last else None
    row = (
        conn.execute(
            text(
                "SELECT count(*) AS n, EXTRACT(EPOCH FROM now() - min(created_at)) AS oldest_s FROM training_samples "
                "WHERE CAST(:since AS timestamptz) IS NULL OR created_at > CAST(:since AS timestamptz)"
            ),
            {"since": since},
        )
        .mappings()
        .one()
    )
    oldest = row["oldest_s"]
    return _lag(
        int(row["n"]),
        "samples",
        None if last else "no trained checkpoint yet: every scored sample is waiting",
        checkpoint_id=last["id"] if last else None,
        checkpoint_age_s=round(float(last["age_s"]), 1) if last else None,
        data_window_end=since,
        oldest_waiting_s=round(float(oldest), 1) if oldest is not None else None,
    )


# --------------------------------------------------------------------------- canary


def _comparison(row: dict[str, Any], settings: Settings, current_id: int | None) -> dict[str, Any]:
    """The numbers of one ``canary.decision`` row, flattened for the page."""
    details = row["details"] or {}
    primary = details.get("primary") or {}
    canary = details.get("canary") or {}
    cs = settings.serving.canary
    return {
        "at": row["at"],
        "target": row["target"],
        "deployment_id": canary.get("deployment_id"),
        "current": current_id is not None and row["target"] == f"deployment:{current_id}",
        "success": row["success"],
        "action": details.get("action"),
        "reason": details.get("reason"),
        "metric": details.get("metric"),
        "weight": details.get("weight"),
        "new_weight": details.get("new_weight"),
        "step": details.get("step"),
        "margin": details.get("margin"),
        "canary_version": canary.get("policy_version"),
        "stable_version": (details.get("stable") or {}).get("policy_version"),
        **{
            k: primary.get(k)
            for k in ("estimate", "lower", "upper", "n_canary", "n_stable", "mean_canary", "mean_stable", "alpha")
        },
        "non_inferiority_margin": cs.non_inferiority_margin,
        "step_margin": cs.step_margin,
        "regression_margin": cs.regression_margin,
        "guards": {
            name: {k: g.get(k) for k in ("estimate", "lower", "upper", "margin", "tripped")}
            for name, g in (details.get("guards") or {}).items()
            if isinstance(g, dict)
        },
        "error": details.get("error"),
    }


def canary_comparison(conn: Connection, settings: Settings, canary_id: int | None) -> dict[str, Any] | None:
    """The newest decision about the active canary (else the newest of any canary) with its history."""
    query = (
        "SELECT id, at, target, details, success FROM audit_log WHERE action = 'canary.decision' "
        "{where} ORDER BY id DESC LIMIT :limit"
    )
    rows: list[dict[str, Any]] = []
    if canary_id is not None:
        rows = [
            dict(r)
            for r in conn.execute(
                text(query.format(where="AND target = :target")),
                {"target": f"deployment:{canary_id}", "limit": HISTORY_LIMIT},
            ).mappings()
        ]
    if not rows:
        rows = [dict(r) for r in conn.execute(text(query.format(where="")), {"limit": 1}).mappings()]
    if not rows:
        return None
    out = _comparison(rows[0], settings, canary_id)
    out["history"] = [
        {
            "at": r["at"],
            "action": (r["details"] or {}).get("action"),
            **{
                k: ((r["details"] or {}).get("primary") or {}).get(k)
                for k in ("estimate", "lower", "upper", "n_canary")
            },
        }
        for r in reversed(rows)
    ]
    return out


# --------------------------------------------------------------------------- the whole picture


def traffic(stable: dict[str, Any] | None, canary: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Share of new sessions per deployment: an active canary gets its weight, stable the rest."""
    out = []
    share = float(canary["weight"]) if canary and canary.get("status") == "active" else 0.0
    share = min(max(share, 0.0), 1.0)
    if stable:
        out.append(
            {
                "role": "stable",
                "policy_version": stable.get("policy_version"),
                "checkpoint_id": stable.get("checkpoint_id"),
                "weight": round(1.0 - share, 6),
            }
        )
    if canary:
        out.append(
            {
                "role": "canary",
                "policy_version": canary.get("policy_version"),
                "checkpoint_id": canary.get("checkpoint_id"),
                "weight": round(share, 6),
                "status": canary.get("status"),
            }
        )
    return out


def recent_events(conn: Connection, limit: int = EVENTS_LIMIT) -> list[dict[str, Any]]:
    """The newest deployment changes and canary decisions of the audit log, newest first."""
    return [
        {
            "at": r["at"],
            "actor": r["actor"],
            "action": r["action"],
            "target": r["target"],
            "success": r["success"],
            "reason": (r["details"] or {}).get("reason") or (r["details"] or {}).get("error"),
        }
        for r in conn.execute(
            text(
                "SELECT at, actor, action, target, success, details FROM audit_log "
                "WHERE action LIKE 'deploy.%' OR action = 'canary.decision' ORDER BY id DESC LIMIT :limit"
            ),
            {"limit": limit},
        ).mappings()
    ]


def dashboard_data(engine: Engine, settings: Settings, kafka: KafkaLagProbe | None = None) -> dict[str, Any]:
    """Everything ``GET /v1/dashboard`` answers (see the module docstring)."""
    fleet = settings.serving.fleet
    status = fleet_status(engine, fleet).to_dict()
    snap = snapshot(engine, fleet)
    canary = status["canary"]
    with engine.connect() as conn:
        now = conn.execute(text("SELECT now()")).scalar_one()
        comparison = canary_comparison(
            conn, settings, canary["id"] if canary and canary["status"] == "active" else None
        )
        lag = {"rewarding": rewarding_lag(conn, settings), "trainer": trainer_lag(conn)}
        events = recent_events(conn)
    with Session(engine) as session:
        trainer_pause, canary_pause = pause_state(session, "trainer"), canary_pause_state(session)
    lag["kafka"] = kafka.get() if kafka is not None else _lag(None, "records", "not measured")
    return {
        "generated_at": now,
        "fleet": fleet,
        "stable": status["stable"],
        "canary": canary,
        "replicas": status["replicas"],
        "traffic": traffic(status["stable"], canary),
        "checkpoints": [asdict(c) for c in snap.checkpoints],
        "canary_comparison": comparison,
        "lag": lag,
        "counts": {
            "raw_events": snap.raw_events,
            "sessions": snap.sessions,
            "rewards": snap.rewards,
            "samples": snap.samples,
            "promotions": snap.promotions,
            "rollbacks": snap.rollbacks,
            "cycles": snap.cycles,
        },
        "last_cycle": snap.last_cycle,
        "paused": {"trainer": _pause(trainer_pause), "canary": _pause(canary_pause)},
        "events": events,
    }


def _pause(state: Any) -> dict[str, Any]:
    at: datetime | None = state.at
    return {"paused": state.paused, "actor": state.actor, "at": at, "reason": state.reason}
