"""Prometheus metrics of the rewarding worker."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from rewarding.detectors import DetectorReport

EVENTS = Counter("flywheel_rewarding_events_total", "Events consumed, by outcome", ["outcome"])
"""outcome: ``applied``, ``duplicate``, ``invalid`` (failed parse_event), ``unattached`` (feedback by
completion id alone, attached and re-produced by ingest), ``key_mismatch``, ``partition_mismatch``."""
APPLIED = EVENTS.labels("applied")
DUPLICATE = EVENTS.labels("duplicate")
SESSIONS = Counter("flywheel_rewarding_sessions_total", "Scored sessions by store decision", ["decision", "reason"])
SAMPLES = Counter("flywheel_rewarding_samples_total", "Samples written to Postgres")
SAMPLES_SKIPPED = Counter("flywheel_rewarding_samples_skipped_total", "Completions without a sample", ["reason"])
PUBLISHED = Counter("flywheel_rewarding_published_total", "Reward versions published on the scored topic")
EXTRACTOR_FAILURES = Counter(
    "flywheel_rewarding_extractor_failures_total",
    "Recorded extractor failures (e.g. unparsable judge answers)",
    ["extractor"],
)
STORE_ERRORS = Counter("flywheel_rewarding_store_errors_total", "Reward batches not stored (database unreachable)")
EVICTED = Counter("flywheel_rewarding_evicted_total", "Session states dropped after their retention")
STAGE_SECONDS = Counter("flywheel_rewarding_stage_seconds_total", "Wall time spent per processing stage", ["stage"])
"""stage: ``apply`` (parse + table), ``score``, ``store``, ``publish``, ``mark``."""
OPEN_SESSIONS = Gauge("flywheel_rewarding_sessions_in_table", "Session states held by this worker")
FINALIZE_LAG = Histogram(
    "flywheel_rewarding_finalize_lag_seconds",
    "From a session's due time to its reward commit",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300),
)
DETECTOR = Gauge("flywheel_rewarding_detector", "Reward-hacking detector metric", ["policy_version", "metric"])
DETECTOR_FLAG = Gauge(
    "flywheel_rewarding_detector_flagged",
    "1 when a detector metric shifted beyond its bound",
    ["policy_version", "metric"],
)


def publish_report(report: DetectorReport) -> None:
    """Set the detector gauges from a report."""
    flagged = {(s.policy_version, s.metric) for s in report.shifts}
    for policy in report.policies:
        for metric, value in policy.metrics().items():
            if value is not None:
                DETECTOR.labels(policy.policy_version, metric).set(value)
            shifted = (policy.policy_version, metric) in flagged
            DETECTOR_FLAG.labels(policy.policy_version, metric).set(1.0 if shifted else 0.0)
