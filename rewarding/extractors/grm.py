"""GRM: a judge model scores the session by several rubrics.

Every rubric is a prompt demanding a strict answer format (a regex whose group 1 is the
score). An answer that does not match the whole format, or a score outside the rubric's
range, is a recorded failure, never a zero. Parsed scores are normalised to [0, 1] and
aggregated by the configured rule (mean, median or min); when they span more than the
disagreement threshold the session is flagged ``disagreement`` (reward hacking often
pleases one rubric and not another). Too few parsed rubrics: no GRM value, failures kept.
"""

from __future__ import annotations

import asyncio
import re
import statistics
from dataclasses import dataclass

from flywheel.core.settings import GrmSettings, RubricSettings
from rewarding.extractors.base import Components, Extractor, mean
from rewarding.grm import JudgeClient, JudgeError
from rewarding.session_state import Session


@dataclass(frozen=True)
class RubricResult:
    """One rubric's outcome: a normalised score, or a failure."""

    rubric: str
    score: float | None
    answer: str | None
    failure: str | None


def parse_score(rubric: RubricSettings, answer: str) -> float:
    """The normalised score of a strictly formatted answer; ValueError naming what is wrong otherwise."""
    match = re.fullmatch(rubric.pattern, answer.strip())
    if match is None or match.lastindex is None:
        raise ValueError(f"answer does not match {rubric.pattern!r}: {answer[:80]!r}")
    score = float(match.group(1))
    if not rubric.min_score <= score <= rubric.max_score:
        raise ValueError(f"score {score} outside [{rubric.min_score}, {rubric.max_score}]")
    return (score - rubric.min_score) / (rubric.max_score - rubric.min_score)


def aggregate(scores: list[float], rule: str) -> float:
    """Combine normalised rubric scores by ``mean``, ``median`` or ``min``."""
    if rule == "mean":
        return mean(scores)
    if rule == "median":
        return statistics.median(scores)
    if rule == "min":
        return min(scores)
    raise ValueError(f"unknown GRM aggregation {rule!r}")


def transcript(session: Session, max_chars: int) -> str:
    """The conversation the judge sees: the last completion's prompt (no system) and its answer."""
    if not session.completions:
        return ""
    last = session.completions[-1]
    lines = [f"{m.role}: {m.content or ''}" for m in last.prompt_messages if m.role != "system"]
    if last.prompt_text:
        lines.append(f"user: {last.prompt_text}")
    lines.append(f"assistant: {last.completion_text}")
    text = "\n".join(lines)
    return text[-max_chars:]


class GrmExtractor(Extractor):
    """Rubric scores from an OpenAI-compatible judge."""

    name = "grm"
    version = "1"
    calls_out = True

    def __init__(self, settings: GrmSettings, client: JudgeClient):
        self.settings = settings
        self.client = client

    async def judge(self, rubric: RubricSettings, text: str) -> RubricResult:
        """Ask one rubric and parse the answer strictly."""
        s = self.settings
        prompt = rubric.prompt.replace("{transcript}", text)
        regex = rubric.pattern if s.structured_output else None
        try:
            answer = await self.client.complete(prompt, max_tokens=s.max_tokens, temperature=s.temperature, regex=regex)
        except JudgeError as err:
            return RubricResult(rubric.name, None, None, f"{rubric.name}: judge unavailable: {err}")
        try:
            return RubricResult(rubric.name, parse_score(rubric, answer), answer, None)
        except ValueError as err:
            return RubricResult(rubric.name, None, answer, f"{rubric.name}: unparsable: {err}")

    async def aextract(self, session: Session) -> Components:
        if not session.completions:
            return Components(value=None)
        text = transcript(session, self.settings.max_transcript_chars)
        results = await asyncio.gather(*(self.judge(r, text) for r in self.settings.rubrics))
        return self.combine(results)

    def combine(self, results: list[RubricResult]) -> Components:
        """Components from the rubric results."""
        terms = {r.rubric: r.score for r in results if r.score is not None}
        failures = tuple(r.failure for r in results if r.failure is not None)
        details = {"answers": {r.rubric: (r.answer or "")[:200] for r in results}}
        metrics = {"rubrics_parsed": float(len(terms)), "rubrics_failed": float(len(failures))}
        if len(terms) < self.settings.min_valid_rubrics:
            return Components(value=None, metrics=metrics, failures=failures, details=details)
        scores = list(terms.values())
        spread = max(scores) - min(scores)
        disagree = spread > self.settings.disagreement_threshold
        metrics.update({"spread": spread, "disagreement": 1.0 if disagree else 0.0})
        return Components(
            value=aggregate(scores, self.settings.aggregation),
            terms=terms,
            metrics=metrics,
            flags=("disagreement",) if disagree else (),
            failures=failures,
            details=details,
        )

    def extract(self, session: Session) -> Components:
        """Synchronous use outside an event loop (tests, scripts)."""
        return asyncio.run(self.aextract(session))

    async def aclose(self) -> None:
        await self.client.aclose()
