"""The demo's agent product: a calculator assistant, written the way a product engineer would.

It knows nothing of Flywheel's internals. It talks to the router with the official
``openai`` client, logs through the SDK (``fw.wrap_openai`` records every completion with
its token ids, logprobs and policy version; the tool calls are logged explicitly), reports
the verifiable outcome (was the answer right?) and, later, what its simulated users did:
they accept most right answers, revert most wrong ones, sometimes ask again, with noise
and delays, as people do.

:class:`DemoAgent` runs ``concurrency`` sessions at a time until stopped.
"""

from __future__ import annotations

import heapq
import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import openai

from flywheel.sdk import Flywheel
from flywheel.task import arith

log = logging.getLogger("flywheel.demo.agent")


@dataclass(frozen=True)
class UserModel:
    """How simulated users react to an answer (probabilities, delays in seconds)."""

    accept_if_right: float = 0.85
    """A right answer is accepted with this probability (else left alone)."""
    accept_if_wrong: float = 0.05
    """A wrong answer is accepted anyway (users miss mistakes)."""
    revert_if_wrong: float = 0.6
    """A wrong answer is reverted with this probability."""
    follow_up_if_wrong: float = 0.3
    """The user asks again, dissatisfied."""
    delay_s: tuple[float, float] = (0.2, 2.0)
    """Feedback arrives this long after the session ends (uniform)."""


@dataclass
class AgentStats:
    """What the product saw (the demo's own ground truth, next to what Flywheel computes)."""

    sessions: int = 0
    solved: int = 0
    failed_requests: int = 0
    feedback: int = 0
    errors: Counter[str] = field(default_factory=Counter)

    def snapshot(self) -> dict[str, Any]:
        return {
            "sessions": self.sessions,
            "solved": self.solved,
            "failed_requests": self.failed_requests,
            "feedback": self.feedback,
            "errors": dict(self.errors),
        }


class DemoAgent:
    """Runs task sessions through the router with ``concurrency`` worker threads."""

    def __init__(
        self,
        fw: Flywheel,
        router_url: str,
        *,
        api_key: str,
        concurrency: int = 4,
        max_tokens: int = 24,
        user: UserModel | None = None,
        seed: int = 0,
        split: arith.Split = "train",
    ):
        self.fw = fw
        self.client = fw.wrap_openai(
            openai.OpenAI(base_url=f"{router_url.rstrip('/')}/v1", api_key=api_key, max_retries=2, timeout=120)
        )
        self.concurrency = concurrency
        self.max_tokens = max_tokens
        self.user = user or UserModel()
        self.split = split
        self.problems = arith.all_problems(split)
        self.stats = AgentStats()
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._timer_seq = 0
        self._timer_cv = threading.Condition()
        self.model = "flywheel"
        """Model name sent to the router (it routes by session and rewrites the name)."""

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start the worker threads and the feedback timer."""
        self._stop.clear()
        self._threads = [threading.Thread(target=self._work, args=(i,), name=f"agent-{i}", daemon=True)
                         for i in range(self.concurrency)]  # fmt: skip
        self._threads.append(threading.Thread(target=self._deliver_feedback, name="agent-feedback", daemon=True))
        for thread in self._threads:
            thread.start()

    def stop(self, timeout_s: float = 120.0) -> None:
        """Let running sessions finish, deliver pending feedback, stop the threads."""
        self._stop.set()
        with self._timer_cv:
            self._timer_cv.notify_all()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(deadline - time.monotonic(), 0.1))

    # -- one session -------------------------------------------------------------------------

    def _work(self, index: int) -> None:
        rng = random.Random(self._rng.random() + index)
        while not self._stop.is_set():
            problem = rng.choice(self.problems)
            try:
                self.play(problem, rng)
            except openai.OpenAIError as err:
                with self._lock:
                    self.stats.failed_requests += 1
                    self.stats.errors[type(err).__name__] += 1
                log.warning("session failed: %s: %s", type(err).__name__, err)
                time.sleep(0.5)

    def play(self, problem: arith.Problem, rng: random.Random) -> arith.Episode:
        """One user session: the task, the tool calls, the outcome; feedback scheduled for later."""
        with self.fw.session(user_id=f"user-{rng.randrange(1000)}", task=f"arith:{problem.kind}",
                             group_key=problem.id, metadata={"product": "calculator-assistant"}) as s:  # fmt: skip

            def generate(messages: list[dict[str, str]]) -> str:
                out = self.client.chat.completions.create(
                    model=self.model, messages=messages, max_tokens=self.max_tokens, temperature=1.0
                )
                return out.choices[0].message.content or ""

            episode = arith.run_episode(problem, generate)
            for turn in episode.turns:
                if turn.tool_call is not None:
                    call_id = s.tool_call("calc", turn.tool_call.expression)
                    s.tool_result(call_id, turn.tool_result or "", is_error=turn.tool_error)
            s.outcome("task_solved", episode.success)
            session_id = s.session_id
        with self._lock:
            self.stats.sessions += 1
            self.stats.solved += episode.success
        self._react(session_id, episode.success, rng)
        return episode

    def _react(self, session_id: str, success: bool, rng: random.Random) -> None:
        """What the user does with the answer, some time later."""
        u = self.user
        actions: list[tuple[str, dict[str, Any]]] = []
        if success and rng.random() < u.accept_if_right:
            actions.append(("accept", {}))
        elif not success:
            if rng.random() < u.accept_if_wrong:
                actions.append(("accept", {}))
            elif rng.random() < u.revert_if_wrong:
                actions.append(("revert", {}))
            if rng.random() < u.follow_up_if_wrong:
                actions.append(("follow_up", {"dissatisfied": True, "text": "that is wrong, try again"}))
        for kind, fields in actions:
            delay = rng.uniform(*u.delay_s)
            self._later(delay, lambda k=kind, f=fields: self._feedback(session_id, k, f))

    def _feedback(self, session_id: str, kind: str, fields: dict[str, Any]) -> None:
        self.fw.feedback(session_id, kind, **fields)
        with self._lock:
            self.stats.feedback += 1

    # -- delayed feedback ----------------------------------------------------------------------

    def _later(self, delay_s: float, action: Callable[[], None]) -> None:
        with self._timer_cv:
            self._timer_seq += 1
            heapq.heappush(self._timers, (time.monotonic() + delay_s, self._timer_seq, action))
            self._timer_cv.notify()

    def _deliver_feedback(self) -> None:
        while True:
            with self._timer_cv:
                while True:
                    if self._stop.is_set() and not self._timers:
                        return
                    if self._timers and self._timers[0][0] <= time.monotonic():
                        _, _, action = heapq.heappop(self._timers)
                        break
                    # stopping: deliver what is pending at once instead of waiting out the delays
                    if self._stop.is_set():
                        _, _, action = heapq.heappop(self._timers)
                        break
                    wait = self._timers[0][0] - time.monotonic() if self._timers else 1.0
                    self._timer_cv.wait(max(wait, 0.01))
            action()
