"""The scorer's two entry points give the same scored session."""

from __future__ import annotations

import asyncio
import random

from flywheel.core.settings import RewardingSettings
from rewarding.scorer import Scorer
from rewarding.session_state import Session
from rewarding.synthetic import arith_session


def no_judge() -> str:
    raise AssertionError("no judge in this test")


def test_score_local_equals_score_for_local_extractors() -> None:
    scorer = Scorer.from_settings(RewardingSettings(), no_judge)
    assert not scorer.calls_out
    rng = random.Random(3)
    for _ in range(5):
        built = arith_session(rng, project="p")
        session = Session.from_events("p", built.session_id, built.events)
        assert scorer.score_local(session) == asyncio.run(scorer.score(session))
