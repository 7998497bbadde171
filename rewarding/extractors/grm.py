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
from typing import Literal

from pydantic import BaseModel, Field, SecretStr, model_validator

from rewarding.extractors.base import BuildContext, Components, Extractor, mean
from rewarding.grm import JudgeClient, JudgeConfig, JudgeError
from rewarding.session_state import Session


class RubricSettings(BaseModel):
    """One judge rubric: a prompt and the strict answer format it demands."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    """Rubric name, a key in the components."""
    prompt: str = Field(min_length=1, max_length=20_000)
    """User message sent to the judge; ``{transcript}`` is replaced by the session transcript."""
    pattern: str = Field(r"SCORE: ([1-5])", min_length=1, max_length=512)
    """Regex the whole stripped answer must match; group 1 is the score. Anything else is a failure."""
    min_score: float = Field(1.0, ge=-1e6, le=1e6)
    """Lowest score the format allows (normalised to 0)."""
    max_score: float = Field(5.0, ge=-1e6, le=1e6)
    """Highest score the format allows (normalised to 1)."""

    @model_validator(mode="after")
    def _range(self) -> RubricSettings:
        if self.max_score <= self.min_score:
            raise ValueError("rubric max_score must exceed min_score")
        return self


def _default_rubrics() -> list[RubricSettings]:
    return [
        RubricSettings(
            name="correctness",
            prompt=(
                "Rate how correct the assistant's final answer is.\n{transcript}\nReply exactly SCORE: N with N 1-5."
            ),
        ),
        RubricSettings(
            name="helpfulness",
            prompt="Rate how helpful the assistant was.\n{transcript}\nReply exactly SCORE: N with N 1-5.",
        ),
    ]


class GrmSettings(BaseModel):
    """Generative reward model: an OpenAI-compatible judge scoring sessions by several rubrics."""

    enabled: bool = False
    """Call the judge; when off the GRM term is absent from every reward."""
    base_url: str | None = None
    """Judge endpoint (``http://host:port``, no ``/v1``); None uses the first vLLM replica (``vllm.urls``)."""
    model: str | None = Field(None, max_length=256)
    """Model name sent to the judge; None asks the endpoint's ``/v1/models`` for its first model."""
    api_key: SecretStr | None = None
    """Bearer token for the judge, if it wants one."""
    rubrics: list[RubricSettings] = Field(default_factory=_default_rubrics, min_length=1, max_length=16)
    """The rubrics; every session is judged by each of them."""
    aggregation: Literal["mean", "median", "min"] = "mean"
    """How the normalised rubric scores are combined."""
    disagreement_threshold: float = Field(0.5, ge=0.0, le=1.0)
    """Rubrics disagree when their normalised scores span more than this."""
    min_valid_rubrics: int = Field(1, ge=1, le=16)
    """Fewest parsed rubric answers for a GRM value; below it the GRM term is a recorded failure."""
    structured_output: bool = True
    """Ask the server (vLLM ``structured_outputs``) to constrain answers to the rubric pattern."""
    max_tokens: int = Field(8, ge=1, le=4096)
    """Longest judge answer."""
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    """Judge sampling temperature (0: greedy, so a recompute gets the same answer)."""
    max_transcript_chars: int = Field(400, ge=16, le=1_000_000)
    """The transcript shown to the judge is cut to its last this many characters."""
    timeout_s: float = Field(30.0, gt=0.0, le=600.0)
    """Deadline of one judge request attempt, from sending it to the whole answer read (not per socket read)."""
    retries: int = Field(2, ge=0, le=10)
    """Retries of a request that timed out, failed to connect or got HTTP 429/5xx."""
    retry_backoff_s: float = Field(0.5, ge=0.0, le=60.0)
    """First retry delay; doubled on each further retry."""
    concurrency: int = Field(4, ge=1, le=1024)
    """Most judge requests in flight per worker."""
    cache_size: int = Field(10_000, ge=0, le=10_000_000)
    """Judge answers cached by content hash (model, rubric, prompt); 0 disables the cache."""


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
    Settings = GrmSettings
    unhashed = frozenset(
        {"base_url", "api_key", "timeout_s", "retries", "retry_backoff_s", "concurrency", "cache_size"}
    )
    """How the judge is reached, not what it answers."""
    calls_out = True

    def __init__(self, settings: GrmSettings, client: JudgeClient):
        self.settings = settings
        self.client = client

    @classmethod
    def enabled(cls, settings: GrmSettings) -> bool:
        """The judge is off by default: weighted or not, it runs only when ``enabled``."""
        return settings.enabled

    @classmethod
    def build(cls, settings: GrmSettings, context: BuildContext) -> GrmExtractor:
        """A judge client for ``settings.base_url``, else the context's judge URL (the first vLLM replica)."""
        config = JudgeConfig(
            base_url=settings.base_url or context.judge_url(),
            model=settings.model,
            api_key=settings.api_key.get_secret_value() if settings.api_key else None,
            timeout_s=settings.timeout_s,
            retries=settings.retries,
            retry_backoff_s=settings.retry_backoff_s,
            concurrency=settings.concurrency,
            cache_size=settings.cache_size,
        )
        return cls(settings, JudgeClient(config))

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
