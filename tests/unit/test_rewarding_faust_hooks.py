"""The worker's faust app uses the project's hooks: awaited changelogs, recovery to the real
end of each changelog, and the bounded fetch wait (no broker needed: nothing connects)."""

from __future__ import annotations

from flywheel.config import Settings
from rewarding.app import RewardingApp
from rewarding.changelog import ChangelogEndRecovery, ChangelogTable
from rewarding.scorer import Scorer
from rewarding.topics import Topics
from rewarding.transport import ConsumerThread


def test_worker_app_uses_the_changelog_and_fetch_hooks(tmp_path) -> None:
    settings = Settings(run_dir=tmp_path)
    settings.rewarding.fetch_max_wait_s = 0.05
    scorer = Scorer.from_settings(settings.rewarding, lambda: "http://127.0.0.1:1")
    db_url = "postgresql+psycopg://nobody@127.0.0.1:1/none"
    worker = RewardingApp(settings, "127.0.0.1:1", db_url, scorer, Topics("t.events", "t.scored", 2))
    assert isinstance(worker.table, ChangelogTable) and isinstance(worker.marks, ChangelogTable)
    assert isinstance(worker.app.tables.recovery, ChangelogEndRecovery)
    consumer = worker.app.consumer
    assert isinstance(consumer._thread, ConsumerThread)
    assert consumer.transport.fetch_max_wait_ms == 50
