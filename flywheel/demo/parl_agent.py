"""The PARL scenario's agent product: an orchestrator that may hand parts of a sum to sub-agents.

Written the way a product engineer would, like :mod:`flywheel.demo.agent`: the official
``openai`` client wrapped by the SDK, one SDK session per user question with the root role
``orchestrator``, and every sub-agent in its own ``with s.span("subagent", assignment)``,
the sub-agents of one turn running at once in threads. The span's role reaches the router
as the ``x-flywheel-agent-role`` header, so a role pin (``serving.role_pins``) serves every
sub-agent request from the frozen checkpoint while the orchestrator follows stable and
canary. The sub-agents decode greedily (``temperature=0``); the orchestrator samples.

The task and its protocol are :mod:`flywheel.task.parl`; the reward is the ``parl``
extractor's (outcome, annealed r_parallel and r_finish, a cost per critical step).
"""

from __future__ import annotations

import contextvars
import random
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from flywheel.demo.agent import DemoAgent, UserModel
from flywheel.sdk import Flywheel
from flywheel.task import arith, parl

SUBAGENT_MAX_TOKENS = 24
ORCHESTRATOR_MAX_TOKENS = 64
TRAIN_PROBLEMS = 4000
"""Distinct TRAIN problems the simulated users ask (drawn once, deterministic in the seed)."""


class ParlAgent(DemoAgent):
    """Orchestrator sessions through the router; ``concurrency`` of them at a time."""

    def __init__(
        self,
        fw: Flywheel,
        router_url: str,
        *,
        api_key: str,
        concurrency: int = 4,
        max_tokens: int = ORCHESTRATOR_MAX_TOKENS,
        subagent_max_tokens: int = SUBAGENT_MAX_TOKENS,
        user: UserModel | None = None,
        seed: int = 0,
        split: parl.Split = "train",
    ):
        super().__init__(fw, router_url, api_key=api_key, concurrency=concurrency, max_tokens=max_tokens,
                         user=user, seed=seed)  # fmt: skip
        self.subagent_max_tokens = subagent_max_tokens
        self.parl_problems = parl.sample_problems(split, TRAIN_PROBLEMS if split == "train" else 200, seed)
        self.problems = self.parl_problems  # type: ignore[assignment]  # DemoAgent's loop picks from these
        self._pool = ThreadPoolExecutor(max_workers=concurrency * parl.MAX_ASSIGNS, thread_name_prefix="subagent")

    def stop(self, timeout_s: float = 120.0) -> None:
        super().stop(timeout_s)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _complete(self, messages: list[dict[str, str]], max_tokens: int, temperature: float) -> str:
        out = self.client.chat.completions.create(
            model=self.model, messages=messages, max_tokens=max_tokens, temperature=temperature
        )
        return out.choices[0].message.content or ""

    def play(self, problem: Any, rng: random.Random) -> Any:  # a parl.Problem, a parl.Episode
        """One user question: the orchestrator's turns, its sub-agents in spans, the outcome."""
        with self.fw.session(user_id=f"user-{rng.randrange(1000)}", task=f"parl:{problem.kind}",
                             group_key=problem.id, role=parl.ORCHESTRATOR_ROLE,
                             metadata={"product": "parallel-calculator"}) as s:  # fmt: skip

            def generate(messages: list[dict[str, str]]) -> str:
                return self._complete(messages, self.max_tokens, 1.0)

            def subagent(assignment: str) -> arith.Episode:
                with s.span(parl.SUBAGENT_ROLE, assignment) as span:
                    episode = parl.run_subagent(assignment, lambda m: self._complete(m, self.subagent_max_tokens, 0.0))
                    for turn in episode.turns:
                        if turn.tool_call is not None:
                            call_id = span.tool_call("calc", turn.tool_call.expression)
                            span.tool_result(call_id, turn.tool_result or "", is_error=turn.tool_error)
                    span.result = parl.subagent_result(episode)
                    if episode.answer is None:
                        span.end("failed", span.result)
                return episode

            def run_subagents(assignments: list[str]) -> list[arith.Episode]:
                # each sub-agent runs in a copy of this context (the SDK's current scope travels with it)
                futures = [self._pool.submit(contextvars.copy_context().run, subagent, a) for a in assignments]
                return [f.result() for f in futures]

            episode = parl.run_episode(problem, generate, run_subagents)
            for turn in episode.turns:
                if turn.calc is not None:
                    call_id = s.tool_call("calc", turn.calc)
                    result = turn.tool_result or ""
                    s.tool_result(call_id, result, is_error=result.startswith("error"))
            s.outcome("task_solved", episode.success)
            session_id = s.session_id
        with self._lock:
            self.stats.sessions += 1
            self.stats.solved += episode.success
        self._react(session_id, episode.success, rng)
        return episode
