"""Reward extractors as plug-ins: found through their entry points, each validating its own
settings section; one from outside this repository needs no edit here."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from flywheel.core.plugins import PluginError, registered
from flywheel.core.settings import RewardingSettings, ScoringSettings, Settings
from rewarding.composite import config_hash
from rewarding.extractors import GROUP, build_extractors, configured, needed, versions
from rewarding.extractors.grm import GrmExtractor
from rewarding.extractors.outcome import OutcomeExtractorSettings
from rewarding.extractors.parl import ParlExtractor
from rewarding.scorer import Scorer
from rewarding.session_state import Session
from rewarding.synthetic import SessionBuilder

BUILT_IN = {"outcome", "user_signal", "grm", "shaping", "parl", "retrieval", "summary", "scores"}

DEFAULT_HASH = "62588c762edb3a569e0025c22fe35bb38be3804c6368fd1841e6b5de503569ee"
"""``config_hash`` of the default settings (the extractors the default weights run). It was
``70a37cef...01ad7``, as reward rows recorded it when every extractor's settings were a field of the
core's scoring settings, until the built-in ``scores`` extractor (weight 1, no rules) was added; then
``bf73d66d...04604``, until the retrieval and summary extractors took their token-budget settings
(``budget_prune_credit``, ``budget_refusal_penalty``; ``asked_credit``, ``refusal_penalty``)."""


def no_judge() -> str:
    raise AssertionError("no judge here")


def scoring(**extractors: dict) -> RewardingSettings:
    return RewardingSettings.model_validate({"scoring": {"extractors": extractors}})


@pytest.fixture
def brevity(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """An extractor in a package of its own, installed (a dist-info on sys.path) next to Flywheel."""
    package = tmp_path / "acme_rewards"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "brevity.py").write_text(
        textwrap.dedent(
            """
            from pydantic import BaseModel, Field

            from rewarding.extractors import Components, Extractor


            class BrevitySettings(BaseModel):
                max_chars: int = Field(2000, ge=1)


            class Brevity(Extractor):
                name = "brevity"
                version = "3"
                Settings = BrevitySettings

                def __init__(self, settings):
                    self.settings = settings

                def extract(self, session):
                    if not session.completions:
                        return Components(value=None)
                    length = len(session.completions[-1].completion_text)
                    return Components(value=max(0.0, 1.0 - length / self.settings.max_chars))
            """
        )
    )
    info = tmp_path / "acme_rewards-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-rewards\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{GROUP}]\nbrevity = acme_rewards.brevity:Brevity\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registered.cache_clear()
    yield "brevity"
    registered.cache_clear()


def test_the_built_in_extractors_are_registered_with_their_versions() -> None:
    assert BUILT_IN <= set(registered(GROUP))
    assert versions()["grm"] == GrmExtractor.version and versions()["parl"] == ParlExtractor.version


def test_the_default_configuration_keeps_its_hash() -> None:
    settings = RewardingSettings()
    scorer = Scorer.from_settings(settings, no_judge)
    assert scorer.config_hash == DEFAULT_HASH
    assert config_hash(settings.scoring, {n: versions()[n] for n in needed(settings)}) == DEFAULT_HASH


def test_sections_are_validated_by_each_extractor_and_shared_through_the_context() -> None:
    settings = scoring(
        outcome={"rules": {"done": {"kind": "bool", "true_value": 2.0}}},
        parl={"lambda_parallel": 0.5},
        grm={"enabled": True, "timeout_s": "7"},  # text, as from the environment
    )
    settings.scoring.weights["parl"] = 1.0
    known = configured(settings.scoring)
    assert known["grm"].settings.timeout_s == 7.0 and known["shaping"].settings == known["shaping"].cls.Settings()
    built = build_extractors(settings, lambda: "http://judge.invalid:1")
    assert built["parl"].settings.lambda_parallel == 0.5
    assert isinstance(built["parl"].outcomes, OutcomeExtractorSettings)
    assert set(built["parl"].outcomes.rules) == {"done"}  # parl maps outcomes by the outcome extractor's rules
    assert built["grm"].client.config.base_url == "http://judge.invalid:1"  # no base_url: the context's judge
    assert built["grm"].client.config.timeout_s == 7.0


def test_json_text_from_the_environment_fills_structured_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLYWHEEL_REWARDING__SCORING__EXTRACTORS__OUTCOME__RULES", '{"x": {"kind": "linear"}}')
    monkeypatch.setenv("FLYWHEEL_REWARDING__SCORING__EXTRACTORS__SHAPING__ANNEAL__KIND", "cosine")
    monkeypatch.setenv(
        "FLYWHEEL_REWARDING__SCORING__EXTRACTORS__GRM__RUBRICS", '[{"name": "a", "prompt": "{transcript}"}]'
    )
    known = configured(Settings().rewarding.scoring)
    assert known["outcome"].settings.rules["x"].kind == "linear"
    assert known["shaping"].settings.anneal.kind == "cosine"
    assert [r.name for r in known["grm"].settings.rubrics] == ["a"]


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"weights": {"outcome": 1.0, "nonsense": 1.0}}, "nonsense"),
        ({"task_weights": {"t": {"typo": 0.5}}}, "typo"),
        ({"extractors": {"gmr": {"enabled": True}}}, "gmr"),
        ({"extractors": {"grm": {"timeout_s": -1}}}, "rewarding.scoring.extractors.grm.timeout_s"),
        ({"extractors": {"outcome": {"combine": "median"}}}, "rewarding.scoring.extractors.outcome.combine"),
    ],
)
def test_an_unknown_or_misconfigured_extractor_is_refused_by_name(settings: dict, named: str) -> None:
    with pytest.raises(PluginError, match=named):
        build_extractors(RewardingSettings(scoring=settings), no_judge)


def test_an_extractor_from_outside_the_repository_needs_no_edit_here(brevity: str) -> None:
    settings = RewardingSettings(
        scoring={"weights": {"outcome": 1.0, brevity: 0.5}, "extractors": {brevity: {"max_chars": "10"}}}
    )
    scorer = Scorer.from_settings(settings, no_judge)
    assert versions()[brevity] == "3" and scorer.versions == {"outcome": "1", brevity: "3"}
    b = SessionBuilder(project="p")
    b.start()
    b.completion("answer: 4")  # 9 characters of 10
    b.outcome("task_solved", True)
    b.end()
    scored = scorer.score_local(Session.from_events(b.project, b.session_id, b.events))
    assert scored.components[brevity]["value"] == pytest.approx(0.1)
    assert scored.reward == pytest.approx(1.0 + 0.5 * 0.1)
    assert scored.extractor_versions == {"outcome": "1", brevity: "3"}
    with pytest.raises(PluginError, match="rewarding.scoring.extractors.brevity.max_chars"):
        configured(ScoringSettings(extractors={brevity: {"max_chars": 0}}))
