"""Topic creation and checks against the real broker, and the report command."""

from __future__ import annotations

import json
import uuid

import pytest
from kafka.admin import KafkaAdminClient
from typer.testing import CliRunner

from flywheel.core.db.migrate import upgrade
from flywheel.core.settings import Settings
from ingest.cli import app as cli_app
from ingest.topics import ensure_topics

pytestmark = pytest.mark.integration


def _settings(bootstrap: str, partitions: int = 3) -> Settings:
    return Settings(
        environment="test",
        kafka={"bootstrap_servers": bootstrap, "topic_prefix": f"tp{uuid.uuid4().hex[:8]}"},
        ingest={"partitions": partitions, "retention_hours": 2},
    )


def test_topics_are_created_once_with_the_configured_partitions(kafka_bootstrap):
    settings = _settings(kafka_bootstrap)
    first = ensure_topics(settings, kafka_bootstrap)
    prefix = settings.kafka.topic_prefix
    assert [s.spec.name for s in first] == [f"{prefix}.events", f"{prefix}.events.dlq"]
    assert all(s.created and s.ok and s.partitions == 3 for s in first)
    assert first[0].spec.retention_ms == 2 * 3_600_000
    again = ensure_topics(settings, kafka_bootstrap)
    assert all(not s.created and s.ok and s.partitions == 3 for s in again)


def test_a_partition_mismatch_is_reported_not_changed(kafka_bootstrap):
    settings = _settings(kafka_bootstrap, partitions=2)
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    try:
        admin.create_topics({f"{settings.kafka.topic_prefix}.events": {"num_partitions": 5, "replication_factor": 1}})
    finally:
        admin.close()
    events, dlq = ensure_topics(settings, kafka_bootstrap)
    assert not events.ok and events.partitions == 5 and "5 partitions, settings say 2" in events.problems[0]
    assert dlq.created and dlq.ok
    only_check = ensure_topics(_settings(kafka_bootstrap), kafka_bootstrap, create=False)
    assert all(s.problems == ["does not exist"] for s in only_check)


def test_report_command_prints_json(pg_url):
    upgrade(pg_url)
    result = CliRunner().invoke(cli_app, ["report", "--json", "--db-url", pg_url, "--project", "nobody"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["orphans"] == [] and report["unknown_session_events"] == 0 and report["dead_letters"] == []


def test_check_command_passes_only_with_topic_and_schema(kafka_bootstrap, pg_url, monkeypatch):
    from flywheel.core.settings import get_settings

    upgrade(pg_url)
    settings = _settings(kafka_bootstrap)
    ensure_topics(settings, kafka_bootstrap)
    runner = CliRunner()
    args = ["check", "--bootstrap", kafka_bootstrap, "--db-url", pg_url]
    for prefix, code in ((settings.kafka.topic_prefix, 0), (f"missing{uuid.uuid4().hex[:6]}", 1)):
        monkeypatch.setenv("FLYWHEEL_KAFKA__TOPIC_PREFIX", prefix)
        get_settings.cache_clear()
        result = runner.invoke(cli_app, args)
        assert result.exit_code == code, result.output
    get_settings.cache_clear()
    assert "does not exist" in result.output
