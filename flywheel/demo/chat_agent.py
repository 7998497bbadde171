"""A generic agent product for any chat model: arithmetic questions in plain text, scored with partial credit.

The calculator agent of :mod:`flywheel.demo.agent` speaks the project's own tool protocol,
which only the project's base model was pre-trained on. This one asks any chat model (through
the router, with the model's own chat template, via the SDK's ``wrap_openai``) a question of
the calculator task in plain words, "What is 37 + 48?", in one turn, samples at
temperature 0.7, top_p 0.9, top_k 50 (:class:`Sampling`), and reports the outcome
``task_score``: 1.0 for the right number, else partial credit (:func:`partial_credit`), so a
model that solves nothing yet still gets a reward with signal. Rewarding maps ``task_score``
linearly (:data:`REWARD_RULES`, the outcome extractor's rules), and the agent also reports
``task_solved`` (true only for the right number), which the live views read as success.

Used by ``make bench-byo`` (:mod:`bench.byo`) and the architecture tests. Like
:class:`flywheel.demo.agent.DemoAgent` it runs ``concurrency`` sessions at a time until
stopped; :meth:`ChatAgent.play` runs one.
"""

from __future__ import annotations

import logging
import random
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import openai

from flywheel.sdk import Flywheel
from flywheel.task import arith

log = logging.getLogger("flywheel.demo.chat_agent")

OUTCOME = "task_score"
"""The outcome the agent reports: partial credit in [0, 1]."""
REWARD_RULES: dict[str, dict[str, Any]] = {
    OUTCOME: {"kind": "linear", "scale": 1.0, "offset": 0.0, "clip_min": 0.0, "clip_max": 1.0}
}
"""The outcome extractor's rules for this agent (``rewarding.scoring.extractors.outcome.rules``):
``task_score`` is the reward; ``task_solved`` has no rule, so it is recorded but not double counted."""

_NUMBER = re.compile(r"-?\d+")


@dataclass(frozen=True)
class Sampling:
    """How the agent samples (the issue's T=0.7 / top_p=0.9 / top_k=50), and how long a reply may be."""

    temperature: float = 0.7
    top_p: float = 0.9
    top_k: int = 50
    max_tokens: int = 16
    """Short replies keep CPU runs fast (the answer is at most 5 characters)."""

    def request(self) -> dict[str, Any]:
        """The keyword arguments of ``chat.completions.create`` (top_k through ``extra_body``: not an OpenAI field)."""
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_tokens": self.max_tokens,
            "extra_body": {"top_k": self.top_k},
        }


def question(problem: arith.Problem) -> list[dict[str, str]]:
    """The chat of one session: a single user turn (no system turn: some chat templates refuse one)."""
    return [{"role": "user", "content": f"What is {problem.a} {problem.op} {problem.b}? Reply with the number only."}]


def partial_credit(problem: arith.Problem, reply: str) -> float:
    """The reply's score in [0, 1]: 1.0 when its first number is the answer, else partial credit.

    Partial credit (at most 0.9, so only the right answer scores 1): 0.2 for answering with a
    number at all, up to 0.4 for the answer's digits that the reply holds (as a multiset), up to
    0.3 for how close the first number is (1 - relative error, floored at 0).
    """
    numbers = [int(n) for n in _NUMBER.findall(reply)]
    if numbers and numbers[0] == problem.answer:
        return 1.0
    want = Counter(str(abs(problem.answer)))
    have = Counter(ch for ch in reply if ch.isdigit())
    digits = sum((want & have).values()) / sum(want.values())
    score = 0.4 * digits
    if numbers:
        score += 0.2
        error = abs(numbers[0] - problem.answer) / max(abs(problem.answer), 1)
        score += 0.3 * max(0.0, 1.0 - error)
    return round(min(score, 0.9), 6)


def served_version(response: Any) -> str | None:
    """The policy version that produced ``response``: the router's ``"flywheel"`` member of the body."""
    meta = getattr(response, "flywheel", None)
    return meta.get("policy_version") if isinstance(meta, dict) else None


@dataclass
class ChatStats:
    """What the product saw."""

    sessions: int = 0
    solved: int = 0
    score_sum: float = 0.0
    failed_requests: int = 0
    versions: Counter[str] = field(default_factory=Counter)
    """Sessions per policy version (the router's ``x-flywheel-policy-version`` header)."""
    errors: Counter[str] = field(default_factory=Counter)

    def snapshot(self) -> dict[str, Any]:
        return {
            "sessions": self.sessions,
            "solved": self.solved,
            "mean_score": round(self.score_sum / self.sessions, 4) if self.sessions else None,
            "failed_requests": self.failed_requests,
            "versions": dict(self.versions),
            "errors": dict(self.errors),
        }


class ChatAgent:
    """Plays one-turn arithmetic sessions through the router with ``concurrency`` worker threads."""

    def __init__(
        self,
        fw: Flywheel,
        router_url: str,
        *,
        api_key: str,
        concurrency: int = 4,
        sampling: Sampling | None = None,
        seed: int = 0,
        split: arith.Split = "train",
        model: str = "flywheel",
    ):
        self.fw = fw
        self.client = fw.wrap_openai(
            openai.OpenAI(base_url=f"{router_url.rstrip('/')}/v1", api_key=api_key, max_retries=2, timeout=120)
        )
        self.concurrency = concurrency
        self.sampling = sampling or Sampling()
        self.problems = arith.all_problems(split)
        self.model = model
        """Model name sent to the router (the fleet's alias: the router picks the version and rewrites it)."""
        self.stats = ChatStats()
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        """Start the worker threads."""
        self._stop.clear()
        self._threads = [threading.Thread(target=self._work, args=(i,), name=f"chat-agent-{i}", daemon=True)
                         for i in range(self.concurrency)]  # fmt: skip
        for thread in self._threads:
            thread.start()

    def stop(self, timeout_s: float = 120.0) -> None:
        """Let running sessions finish and stop the threads."""
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(deadline - time.monotonic(), 0.1))

    def _work(self, index: int) -> None:
        rng = random.Random(self._rng.random() + index)
        while not self._stop.is_set():
            try:
                self.play(rng.choice(self.problems), rng)
            except openai.OpenAIError as err:
                with self._lock:
                    self.stats.failed_requests += 1
                    self.stats.errors[type(err).__name__] += 1
                log.warning("session failed: %s: %s", type(err).__name__, err)
                time.sleep(0.5)

    def play(self, problem: arith.Problem, rng: random.Random | None = None) -> tuple[float, str | None]:
        """One session: ask, score, report; returns (score, the policy version that answered)."""
        rng = rng or self._rng
        with self.fw.session(user_id=f"user-{rng.randrange(1000)}", task=f"byo:{problem.kind}",
                             group_key=problem.id, metadata={"product": "byo-chat"}) as s:  # fmt: skip
            out = self.client.chat.completions.create(
                model=self.model, messages=question(problem), **self.sampling.request()
            )
            version = served_version(out)
            reply = out.choices[0].message.content or ""
            score = partial_credit(problem, reply)
            s.outcome(OUTCOME, score)
            s.outcome("task_solved", score == 1.0)
        with self._lock:
            self.stats.sessions += 1
            self.stats.solved += score == 1.0
            self.stats.score_sum += score
            self.stats.versions[version or "?"] += 1
        return score, version
