"""The ``scores`` extractor: configured named scores -> reward; unconfigured ones ignored and listed."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from pydantic import ValidationError

from flywheel.core.settings import RewardingSettings
from rewarding.composite import combine
from rewarding.extractors import build_extractors, configured
from rewarding.extractors.scores import ScoreRule, ScoresExtractor, ScoresSettings, map_score
from rewarding.extractors.user_signal import UserSignalExtractor, UserSignalSettings
from rewarding.session_state import Session
from rewarding.synthetic import SessionBuilder

T0 = datetime.now(UTC) - timedelta(hours=2)

RULES = {
    "correct": ScoreRule(kind="bool", true_value=1.0, false_value=-1.0),
    "tone": ScoreRule(kind="categorical", categories={"friendly": 0.5, "neutral": 0.0, "rude": -1.0}),
    "stars": ScoreRule(kind="linear", scale=0.5, offset=-1.5, clip_min=-1.0, clip_max=1.0),
    "quality": ScoreRule(kind="threshold", threshold=0.7, above_value=1.0, below_value=0.0),
}


def view(b: SessionBuilder) -> Session:
    return Session.from_events(b.project, b.session_id, b.events)


def score(b: SessionBuilder, name: str, value, **fields) -> None:
    b.feedback("score", name=name, value=value, **fields)


def test_each_rule_kind_maps_its_values() -> None:
    assert [map_score(RULES["correct"], v) for v in (True, False, 1, 0)] == [1.0, -1.0, 1.0, -1.0]
    assert [map_score(RULES["tone"], v) for v in ("friendly", "rude", "sarcastic", 1.0)] == [0.5, -1.0, None, None]
    assert [map_score(RULES["stars"], v) for v in (1, 3, 5)] == [-1.0, 0.0, 1.0]  # clipped at both ends
    assert [map_score(RULES["quality"], v) for v in (0.9, 0.2, "high")] == [1.0, 0.0, None]


def test_configured_scores_become_the_value_and_unconfigured_ones_are_listed() -> None:
    ex = ScoresExtractor(ScoresSettings(rules=RULES))
    b = SessionBuilder(at=T0)
    c1 = b.completion()
    b.end()
    score(b, "correct", True)
    score(b, "tone", "friendly", completion_id=c1.completion_id, comment="polite")
    score(b, "latency_feel", "fast")  # no rule: ignored
    b.feedback("accept")  # not a score
    c = ex.extract(view(b))
    assert c.terms == {"correct": 1.0, "tone": 0.5}
    assert c.value == pytest.approx(0.75)
    assert c.details == {"ignored": ["latency_feel"]}
    assert ScoresExtractor(ScoresSettings(rules=RULES, combine="min")).extract(view(b)).value == 0.5


def test_the_latest_score_per_target_counts_and_targets_are_averaged() -> None:
    ex = ScoresExtractor(ScoresSettings(rules=RULES))
    b = SessionBuilder(at=T0)
    one, two = b.completion(), b.completion()
    score(b, "correct", True, completion_id=one.completion_id)
    score(b, "correct", False, completion_id=one.completion_id)  # corrects the first
    score(b, "correct", True, completion_id=two.completion_id)
    c = ex.extract(view(b))
    assert c.terms == {"correct": 0.0}  # mean of -1 (one, latest) and 1 (two)


def test_values_a_rule_cannot_map_are_listed_not_counted() -> None:
    ex = ScoresExtractor(ScoresSettings(rules=RULES))
    b = SessionBuilder(at=T0)
    score(b, "tone", "sarcastic")
    score(b, "quality", "high")
    c = ex.extract(view(b))
    assert c.value is None and c.terms == {}
    assert c.details == {
        "unmapped": [
            {"name": "quality", "target": "session", "value": "high"},
            {"name": "tone", "target": "session", "value": "sarcastic"},
        ]
    }


def test_nothing_configured_is_no_value_so_the_default_changes_nothing() -> None:
    b = SessionBuilder(at=T0)
    b.outcome("task_solved", True)
    score(b, "correct", False)
    settings = RewardingSettings()
    assert settings.scoring.weights["scores"] == 1.0
    extractors = build_extractors(settings, lambda: "http://judge.invalid")
    scores = extractors["scores"].extract(view(b))
    assert scores.value is None and scores.details == {"ignored": ["correct"]}
    composite = combine({"outcome": extractors["outcome"].extract(view(b)), "scores": scores},
                        {"outcome": 1.0, "scores": 1.0})  # fmt: skip
    assert composite.reward == 1.0 and composite.components["scores"]["weighted"] is None


def test_named_scores_are_not_user_signal() -> None:
    ex = UserSignalExtractor(UserSignalSettings(score={"weight": 1.0}))
    b = SessionBuilder(at=T0)
    score(b, "stars", 5)
    assert ex.extract(view(b)).value is None
    b.feedback("score", score=0.5)  # the unnamed free score still counts
    assert ex.extract(view(b)).terms == {"score": 0.5}


def test_rules_come_from_the_settings_section_and_bad_ones_are_refused() -> None:
    section = {"rules": {"tone": {"kind": "categorical", "categories": {"good": 1, "bad": -1}}}, "combine": "sum"}
    settings = RewardingSettings(scoring={"extractors": {"scores": section}})
    got = configured(settings.scoring)["scores"].settings
    assert isinstance(got, ScoresSettings) and got.rules["tone"].categories == {"good": 1.0, "bad": -1.0}
    with pytest.raises(ValidationError, match="categories: required when kind is 'categorical'"):
        ScoreRule(kind="categorical")
    with pytest.raises(ValidationError, match="categories: only for kind 'categorical'"):
        ScoreRule(kind="bool", categories={"a": 1.0})
    with pytest.raises(ValidationError, match="within"):
        ScoreRule(kind="categorical", categories={"a": 1e7})
