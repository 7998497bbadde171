"""Named scores through the real path: the SDK's ``fw.score`` over the Kafka protocol to a real
rewarding worker process, whose rewards land in a real Postgres.

One session carries a configured boolean score (the session's), a configured categorical score
(one completion's) and an unconfigured numeric one; a second session has an outcome and only an
unconfigured score. The configured scores become the first session's reward; the unconfigured
ones are listed as ignored and change nothing.
"""

from __future__ import annotations

import pytest
from conftest import rewarding_worker, session_rows

from flywheel.sdk import Flywheel
from rewarding.harness import wait_until

pytestmark = pytest.mark.integration

SCORES = {
    "rules": {
        "correct": {"kind": "bool", "true_value": 1.0, "false_value": -1.0},
        "tone": {"kind": "categorical", "categories": {"friendly": 0.5, "neutral": 0.0, "rude": -1.0}},
    }
}
REWARDING = {
    "feedback_window_s": 2.0,
    "session_timeout_s": 6.0,
    "rescore_delay_s": 0.3,
    "timer_interval_s": 0.1,
    "session_timeout_broker_s": 6,
    "rebalance_timeout_s": 6,
    "scoring": {"weights": {"outcome": 1.0, "scores": 1.0}, "extractors": {"scores": SCORES}},
}


def test_configured_scores_become_the_reward_and_unconfigured_ones_are_ignored(
    kafka_bootstrap: str, pg_url: str, tmp_path
) -> None:
    with rewarding_worker(kafka_bootstrap, pg_url, tmp_path, "sc", REWARDING) as run:
        project = run.project
        with Flywheel(project=project, kafka_bootstrap=kafka_bootstrap, topic_prefix=run.prefix,
                      spool_dir=tmp_path / "spool") as fw:  # fmt: skip
            with fw.session(task="qa") as scored:
                cid = scored.completion(model="m", policy_version="pv-1", completion_text="Paris, of course!")
            fw.score(scored, "correct", True, comment="checked against the atlas")
            fw.score(cid, "tone", "friendly")  # by completion id: this process knows its session
            fw.score(scored, "helpfulness", 0.9)  # no rule: ignored
            with fw.session(task="qa") as plain:
                plain.completion(model="m", policy_version="pv-1", completion_text="4")
                plain.outcome("task_solved", True)
                plain.score("vibes", "good")  # no rule: ignored
            assert fw.flush(30) and fw.stats.invalid == 0
        sid, other = scored.session_id, plain.session_id
        wait_until(
            lambda: session_rows(pg_url, "rewards", project, sid) and session_rows(pg_url, "rewards", project, other),
            90,
            "both sessions scored",
        )
        tail = run.log_tail()

    (row,) = session_rows(pg_url, "rewards", project, sid)
    scores = row["components"]["scores"]
    assert scores["terms"] == {"correct": 1.0, "tone": 0.5}, tail
    assert scores["value"] == pytest.approx(0.75) and scores["weighted"] == pytest.approx(0.75)
    assert scores["details"] == {"ignored": ["helpfulness"]}
    assert row["components"]["outcome"]["value"] is None
    assert row["reward"] == pytest.approx(0.75)
    assert row["extractor_versions"]["scores"] == "1"

    (row,) = session_rows(pg_url, "rewards", project, other)
    scores = row["components"]["scores"]
    assert scores["value"] is None and scores["weighted"] is None
    assert scores["details"] == {"ignored": ["vibes"]}
    assert row["reward"] == pytest.approx(1.0)  # the outcome alone: the unconfigured score changed nothing
