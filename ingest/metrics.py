"""Prometheus metrics of the consumer and the gateway (one process-wide registry).

The consumer serves them on ``ingest.metrics_port`` when set; the gateway on ``GET /metrics``.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server

PRODUCED = Counter(
    "flywheel_ingest_produced", "Records this process produced to Kafka and the broker acknowledged.", ["topic"]
)
CONSUMED = Counter("flywheel_ingest_consumed", "Records the consumer read from the events topic.")
WRITTEN = Counter("flywheel_ingest_written", "Events newly inserted into raw_events.")
DUPLICATES = Counter("flywheel_ingest_duplicates", "Valid events already in raw_events (a replay or retry): no-ops.")
DEAD_LETTERED = Counter(
    "flywheel_ingest_dead_lettered", "Records turned into dead letters (topic and table), by kind of fault.", ["kind"]
)
ORPHAN_FEEDBACK = Counter(
    "flywheel_ingest_orphan_feedback",
    "Feedback/outcome events written while their session had no session_start (kept; see `flywheel-ingest report`).",
)
UNATTACHED_FEEDBACK = Counter(
    "flywheel_ingest_unattached_feedback",
    "Feedback by completion id alone (no session) newly kept in pending_feedback.",
)
FEEDBACK_ATTACHED = Counter(
    "flywheel_ingest_feedback_attached",
    "Pending feedback whose session was found and whose resolved copy Kafka acknowledged.",
)
UNKNOWN_COMPLETION = Counter(
    "flywheel_ingest_unknown_completion",
    "Pending feedback reported as unknown_completion: its completion did not arrive in time (kept, still retried).",
)
LAG = Gauge("flywheel_ingest_lag", "Records on the events topic not yet consumed, per partition.", ["partition"])
DB_RETRIES = Counter("flywheel_ingest_db_retries", "Batch writes retried after a transient database error.")
COMMIT_FAILURES = Counter(
    "flywheel_ingest_commit_failures", "Offset commits refused by the group (a rebalance): the records are re-read."
)
BATCH_SECONDS = Histogram(
    "flywheel_ingest_batch_seconds",
    "Time to write one batch to Postgres and commit its offsets.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
GATEWAY_ACCEPTED = Counter("flywheel_ingest_accepted", "Events the gateway accepted (acked by Kafka).", ["project"])
GATEWAY_REJECTED = Counter("flywheel_ingest_rejected", "Events the gateway rejected, by reason kind.", ["kind"])
GATEWAY_REQUESTS = Counter("flywheel_ingest_gateway_requests", "Gateway requests to /v1/events, by status.", ["status"])
FEEDBACK_REQUESTS = Counter(
    "flywheel_ingest_feedback_requests",
    "Browser feedback requests to /v1/feedback (not preflights), by status.",
    ["status"],
)
UNKNOWN_FIELDS = Counter(
    "flywheel_ingest_unknown_fields",
    "Valid events carrying fields this reader does not know (a newer SDK's, same schema version): kept and stored,"
    " never dead-lettered; by where they were seen (gateway, consumer).",
    ["stage"],
)

OTLP_REQUESTS = Counter(
    "flywheel_ingest_otlp_requests", "Gateway requests to /v1/traces (OTLP), by status.", ["status"]
)
OTLP_SPANS = Counter(
    "flywheel_ingest_otlp_spans", "OTLP spans received on /v1/traces, by outcome (mapped, rejected).", ["outcome"]
)
OTLP_REJECTED = Counter(
    "flywheel_ingest_otlp_rejected_spans",
    "OTLP spans that could not be mapped to events (reported in the export's partial success), by reason.",
    ["reason"],
)


def serve(port: int | None, addr: str = "0.0.0.0") -> bool:
    """Serve ``/metrics`` on ``port`` in a background thread; False when ``port`` is None."""
    if port is None:
        return False
    start_http_server(port, addr=addr, registry=REGISTRY)
    return True
