"""User signal: accept, reject, revert, edit size, persisted-after, dissatisfied follow-up, score.

Each kind has a weight and a window (seconds after the session end in which it counts;
before the end always counts). A kind counts once per target, the whole session or one
completion, by its latest occurrence inside the window, so repeating a signal cannot stack
reward. The sum is clipped to ``[-clip, clip]``. No counted signal: no value. Named scores
(feedback of kind ``score`` with a ``name``) are not user signal: the ``scores`` extractor reads them.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from flywheel.core.contracts.events import Feedback, FeedbackKind
from rewarding.extractors.base import Components, Extractor
from rewarding.session_state import Session


class SignalRule(BaseModel):
    """One user signal: its weight and the window in which it counts."""

    weight: float = Field(0.0, ge=-100.0, le=100.0)
    """Reward per occurrence (``edit``: per unit of edit ratio; ``score``: per unit of score)."""
    window_s: float | None = Field(None, gt=0.0, le=365 * 86400.0)
    """The signal counts only if it occurred within this many seconds after the session end; None: any time."""


class UserSignalSettings(BaseModel):
    """What the user did with the agent's work; each kind counts once per target (its latest occurrence)."""

    accept: SignalRule = Field(default_factory=lambda: SignalRule(weight=1.0))
    """The user accepted the work."""
    reject: SignalRule = Field(default_factory=lambda: SignalRule(weight=-1.0))
    """The user rejected it."""
    revert: SignalRule = Field(default_factory=lambda: SignalRule(weight=-1.0, window_s=600.0))
    """The user reverted it ("reverted within 10 minutes")."""
    edit: SignalRule = Field(default_factory=lambda: SignalRule(weight=-0.5))
    """The user changed part of it; the term is weight * edit_ratio."""
    persisted: SignalRule = Field(default_factory=lambda: SignalRule(weight=0.5))
    """The work survived unchanged for at least ``persisted_min_minutes``."""
    persisted_min_minutes: float = Field(30.0, ge=0.0, le=525_600.0)
    """How long the work must survive to count as persisted ("persisted after 30 minutes")."""
    follow_up: SignalRule = Field(default_factory=lambda: SignalRule(weight=-0.5, window_s=3600.0))
    """A dissatisfied follow-up (the user asked again or said it was wrong)."""
    score: SignalRule = Field(default_factory=lambda: SignalRule(weight=0.0))
    """A free score given by the user; the term is weight * score."""
    clip: float = Field(2.0, gt=0.0, le=1e6)
    """The summed signal is clipped to [-clip, clip], so stacking signals cannot run away."""


def in_window(feedback: Feedback, session: Session, rule: SignalRule) -> bool:
    """True when ``feedback`` occurred within the rule's window after the session end."""
    if rule.window_s is None or session.ended_at is None:
        return True
    return (feedback.occurred_at - session.ended_at).total_seconds() <= rule.window_s


class UserSignalExtractor(Extractor):
    """What the user did with the agent's work -> one reward."""

    name = "user_signal"
    version = "1"
    Settings = UserSignalSettings

    def __init__(self, settings: UserSignalSettings):
        self.settings = settings

    def rule(self, kind: FeedbackKind) -> SignalRule:
        """The configured rule of a feedback kind."""
        return getattr(self.settings, kind.value)

    def term(self, feedback: Feedback) -> float | None:
        """The reward of one feedback event, or None when it carries no signal."""
        rule = self.rule(feedback.kind)
        if feedback.kind is FeedbackKind.EDIT:
            return rule.weight * float(feedback.edit_ratio or 0.0)
        if feedback.kind is FeedbackKind.SCORE:
            return rule.weight * float(feedback.score or 0.0)
        if feedback.kind is FeedbackKind.PERSISTED:
            minutes = float(feedback.persisted_minutes or 0.0)
            return rule.weight if minutes >= self.settings.persisted_min_minutes else None
        if feedback.kind is FeedbackKind.FOLLOW_UP:
            return rule.weight if feedback.dissatisfied else None
        return rule.weight

    def extract(self, session: Session) -> Components:
        latest: dict[tuple[str, str], float] = {}
        outside = 0
        for feedback in session.feedback:
            if feedback.name is not None:
                continue  # a named score: the ``scores`` extractor's, where configured
            if not in_window(feedback, session, self.rule(feedback.kind)):
                outside += 1
                continue
            value = self.term(feedback)
            target = str(feedback.completion_id) if feedback.completion_id else "session"
            if value is None:
                latest.pop((feedback.kind.value, target), None)
            else:
                latest[(feedback.kind.value, target)] = value
        metrics = {"outside_window": float(outside)} if outside else {}
        if not latest:
            return Components(value=None, metrics=metrics)
        terms: dict[str, float] = {}
        for (kind, _target), value in sorted(latest.items()):
            terms[kind] = terms.get(kind, 0.0) + value
        total = sum(terms.values())
        clip = self.settings.clip
        return Components(value=min(max(total, -clip), clip), terms=terms, metrics=metrics)
