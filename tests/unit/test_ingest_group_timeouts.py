"""The ingest consumer's group timeouts (docs/reliability.md, "Joining after a stop")."""

from __future__ import annotations

from flywheel.core.settings.ingest import IngestSettings
from ingest.consumer import group_timeouts_ms


def test_the_session_timeout_is_its_own_setting_not_the_poll_interval() -> None:
    assert group_timeouts_ms(IngestSettings()) == (10000, 3000)
    assert group_timeouts_ms(IngestSettings(max_poll_interval_ms=300000, session_timeout_ms=20000)) == (20000, 3000)


def test_the_session_timeout_is_at_most_the_poll_interval_and_heartbeats_three_times_per_session() -> None:
    assert group_timeouts_ms(IngestSettings(max_poll_interval_ms=6000)) == (6000, 2000)
    assert group_timeouts_ms(IngestSettings(session_timeout_ms=1500)) == (1500, 500)
