"""PARL: the orchestrator task of Kimi K2.5's parallel-agent RL, at the calculator's scale.

The user asks for a sum of three to five products, ``What is 17*28+21*3+15*26?``. The
orchestrator can solve it alone, one ``<calc>`` per product, or split it: every
``<assign>17*28</assign>`` in one turn creates a sub-agent and assigns it that product
(K2.5's ``create_subagent`` and ``assign_task`` in one call: a sub-agent here lives for one
assignment). The sub-agents of one turn run in parallel; each is the calculator agent of
:mod:`flywheel.task.arith` (``<calc>`` then ``answer: N``), served by a *frozen* checkpoint,
and what each answered comes back in one ``tool`` message, in order (``476 63 390``). The
orchestrator then adds the parts with ``<calc>476+63+390</calc>`` and replies ``answer: N``.

Time is counted in **critical steps**, as in the report: every orchestrator turn is one
step, and a turn that spawned sub-agents adds the longest of them (they run at once), so
``sum_t (S_main(t) + max_i S_sub,i(t))``. An episode has :data:`MAX_CRITICAL_STEPS` (6): the
orchestrator alone needs ``parts + 2`` (five products do not fit), split it needs 5 for any
number of parts. Outcome: the final answer equals the true sum.

Pure Python (no torch), like the calculator task: the demo agent and the gate import it.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

from flywheel.task import arith

Split = Literal["train", "heldout"]
Message = dict[str, str]
Generate = Callable[[list[Message]], str]
RunSubagents = Callable[[list[str]], list[arith.Episode]]
"""Runs one stage's sub-agents (their assignments, in order) to completion and returns their episodes."""

TASK_VERSION = "parl-v2"
"""v2: factors 2..29 (v1: 10..99, whose base model copied 4-digit numbers wrong and solved nothing)."""
PARTS = (3, 4, 5)
"""How many products a problem sums."""
OPERAND_RANGE = range(2, 30)
MAX_CRITICAL_STEPS = 6
MAX_TURNS = 8
"""Orchestrator turns at most (critical steps end an episode first unless sub-agents answer at once)."""
MAX_ASSIGNS = 8
"""Sub-agents one turn may spawn (more is a tool error)."""
ORCHESTRATOR_ROLE = "orchestrator"
SUBAGENT_ROLE = "subagent"
SYSTEM_PROMPT = "You are an orchestrator. <assign>a*b</assign> sends a part to a sub-agent; <calc> adds; answer: N."
SUBAGENT_PROMPT = "You are a sub-agent. Call <calc>a op b</calc>, then reply answer: N."
ASSIGN_OPEN, ASSIGN_CLOSE = "<assign>", "</assign>"
SUBAGENT_MAX_TURNS = 2
"""A sub-agent calls the calculator and answers: two steps; a third is never needed."""

_ASSIGN_RE = re.compile(re.escape(ASSIGN_OPEN) + r"(.*?)" + re.escape(ASSIGN_CLOSE), re.DOTALL)
_TERM_RE = re.compile(r"\s*(-?\d{1,7})\s*(?:\*\s*(-?\d{1,7})\s*)?")
_QUESTION_RE = re.compile(r"What is\s*([0-9*+\s]+)\?")
FinishReason = Literal["answer", "no_answer", "max_steps", "max_turns", "running"]


@dataclass(frozen=True)
class Problem:
    """A sum of products; ``id`` is stable across processes and machines."""

    parts: tuple[tuple[int, int], ...]

    @property
    def id(self) -> str:
        return f"{TASK_VERSION}:{self.expression}"

    @property
    def expression(self) -> str:
        """``17*28+21*3+15*26``."""
        return "+".join(f"{a}*{b}" for a, b in self.parts)

    @property
    def part_expressions(self) -> list[str]:
        return [f"{a}*{b}" for a, b in self.parts]

    @property
    def answer(self) -> int:
        return sum(a * b for a, b in self.parts)

    @property
    def kind(self) -> str:
        """``parts3`` .. ``parts5``."""
        return f"parts{len(self.parts)}"

    @property
    def split(self) -> Split:
        """By the calculator's id hash (:func:`flywheel.task.arith.split_of`): 20 % held out."""
        return arith.split_of(self.id)

    def to_dict(self) -> dict[str, object]:
        return {"id": self.id, "parts": [list(p) for p in self.parts], "kind": self.kind, "answer": self.answer}


def random_problem(rng: random.Random, split: Split) -> Problem:
    """A problem of ``split`` drawn from ``rng`` (rejection on the split's hash)."""
    while True:
        k = rng.choice(PARTS)
        parts = tuple((rng.choice(OPERAND_RANGE), rng.choice(OPERAND_RANGE)) for _ in range(k))
        problem = Problem(parts)
        if problem.split == split:
            return problem


def sample_problems(split: Split, n: int, seed: int = 0) -> list[Problem]:
    """``n`` distinct problems of ``split``, deterministic in ``seed``."""
    if split not in ("train", "heldout"):
        raise ValueError(f"unknown split {split!r}")
    if n < 0:
        raise ValueError(f"n={n} must be >= 0")
    rng = random.Random(f"{TASK_VERSION}:{split}:{seed}")
    seen: dict[str, Problem] = {}
    while len(seen) < n:
        problem = random_problem(rng, split)
        seen.setdefault(problem.id, problem)
    return list(seen.values())


def problem_from_text(text: str) -> Problem | None:
    """The problem a user message asks, or None."""
    match = _QUESTION_RE.search(text)
    if match is None:
        return None
    parts = []
    for term in match.group(1).replace(" ", "").split("+"):
        a, _, b = term.partition("*")
        if not (a.isdigit() and b.isdigit()):
            return None
        parts.append((int(a), int(b)))
    return Problem(tuple(parts)) if len(parts) in PARTS else None


# --------------------------------------------------------------------------- protocol


def render_messages(problem: Problem) -> list[Message]:
    """The orchestrator's opening messages."""
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": f"What is {problem.expression}?"}]


def subagent_messages(assignment: str) -> list[Message]:
    """A sub-agent's opening messages for ``assignment`` (``17*28``)."""
    return [{"role": "system", "content": SUBAGENT_PROMPT}, {"role": "user", "content": f"What is {assignment}?"}]


def parse_assignments(text: str) -> list[str]:
    """Every ``<assign>...</assign>`` of a turn, in order."""
    return [m.strip() for m in _ASSIGN_RE.findall(text)]


def run_calc(expression: str) -> str:
    """The orchestrator's calculator: a sum of integers or products (``476+63``, ``17*28``)."""
    terms = expression.split("+")
    if not 1 <= len(terms) <= MAX_ASSIGNS:
        return f"error: expected 1 to {MAX_ASSIGNS} terms joined by +"
    total = 0
    for term in terms:
        match = _TERM_RE.fullmatch(term)
        if match is None:
            return "error: expected <calc>n+n+...</calc> or <calc>a*b</calc> with integers"
        a, b = int(match.group(1)), match.group(2)
        total += a * int(b) if b is not None else a
    return str(total)


def subagent_result(episode: arith.Episode) -> str:
    """What a sub-agent reports back: its answer, or ``error`` when it gave none."""
    return str(episode.answer) if episode.answer is not None else "error"


@dataclass
class Turn:
    """One orchestrator turn: its prompt, its completion, and what the tools and sub-agents returned."""

    prompt: list[Message]
    completion: str
    assignments: list[str] = field(default_factory=list)
    subagents: list[arith.Episode] = field(default_factory=list)
    calc: str | None = None
    tool_result: str | None = None

    @property
    def steps(self) -> int:
        """Critical steps of this turn: one, plus its longest sub-agent."""
        return 1 + max((len(e.turns) for e in self.subagents), default=0)


@dataclass
class Episode:
    """One orchestrator episode with its sub-agents."""

    problem: Problem
    messages: list[Message]
    turns: list[Turn] = field(default_factory=list)
    finish_reason: FinishReason = "running"

    @property
    def done(self) -> bool:
        return self.finish_reason != "running"

    @property
    def critical_steps(self) -> int:
        """``sum_t (1 + max_i S_sub,i(t))``."""
        return sum(t.steps for t in self.turns)

    @property
    def subagents(self) -> int:
        return sum(len(t.subagents) for t in self.turns)

    @property
    def answer(self) -> int | None:
        if self.finish_reason != "answer" or not self.turns:
            return None
        return arith.parse_answer(self.turns[-1].completion)

    @property
    def success(self) -> bool:
        return self.answer is not None and self.answer == self.problem.answer

    @property
    def parallel(self) -> bool:
        """True when the orchestrator spawned a sub-agent for every part."""
        return self.subagents >= len(self.problem.parts)

    def to_dict(self) -> dict[str, object]:
        return {
            "problem": self.problem.to_dict(),
            "messages": [dict(m) for m in self.messages],
            "turns": [{"completion": t.completion, "assignments": t.assignments, "calc": t.calc,
                       "tool_result": t.tool_result,
                       "subagents": [[x.completion for x in e.turns] for e in t.subagents]} for t in self.turns],
            "finish_reason": self.finish_reason,
            "answer": self.answer,
            "success": self.success,
            "critical_steps": self.critical_steps,
            "subagents": self.subagents,
        }  # fmt: skip


def start_episode(problem: Problem) -> Episode:
    return Episode(problem=problem, messages=render_messages(problem))


def advance_episode(episode: Episode, completion: str, run_subagents: RunSubagents) -> Episode:
    """Record one orchestrator turn; run its sub-agents (``run_subagents``) or its calculator call."""
    if episode.done:
        raise ValueError("episode already finished")
    turn = Turn(prompt=[dict(m) for m in episode.messages], completion=completion)
    episode.turns.append(turn)
    episode.messages.append({"role": "assistant", "content": completion})
    turn.assignments = parse_assignments(completion)
    calc = arith.parse_tool_call(completion)
    if turn.assignments:
        if len(turn.assignments) > MAX_ASSIGNS:
            turn.tool_result = f"error: at most {MAX_ASSIGNS} sub-agents per turn"
        else:
            turn.subagents = list(run_subagents(turn.assignments))
            if len(turn.subagents) != len(turn.assignments):
                raise ValueError(f"run_subagents returned {len(turn.subagents)} episodes for "
                                 f"{len(turn.assignments)} assignments")  # fmt: skip
            turn.tool_result = " ".join(subagent_result(e) for e in turn.subagents)
    elif calc is not None:
        turn.calc = calc.expression
        turn.tool_result = run_calc(turn.calc) if calc.closed else f"error: missing {arith.TOOL_CLOSE}"
    else:
        episode.finish_reason = "answer" if arith.parse_answer(completion) is not None else "no_answer"
        return episode
    episode.messages.append({"role": "tool", "content": turn.tool_result})
    if episode.critical_steps >= MAX_CRITICAL_STEPS:
        episode.finish_reason = "max_steps"
    elif len(episode.turns) >= MAX_TURNS:
        episode.finish_reason = "max_turns"
    return episode


def start_subagent(assignment: str) -> arith.Episode:
    """A sub-agent's episode: the calculator agent on ``assignment`` (scored against a placeholder problem when the
    assignment is not one), with the sub-agent's prompt."""
    problem = arith.problem_from_text(f"What is {assignment}?") or arith.Problem(0, "+", 0)
    return arith.start_episode(problem, SUBAGENT_MAX_TURNS, subagent_messages(assignment))


def run_subagent(assignment: str, generate: Generate) -> arith.Episode:
    """One sub-agent run to its end (:func:`flywheel.task.arith.run_episode` with the sub-agent's opening)."""
    opening = start_subagent(assignment)
    return arith.run_episode(opening.problem, generate, SUBAGENT_MAX_TURNS, opening.messages)


def run_episode(problem: Problem, generate: Generate, run_subagents: RunSubagents) -> Episode:
    """One orchestrator episode; ``generate`` answers orchestrator chats, ``run_subagents`` runs a stage."""
    episode = start_episode(problem)
    while not episode.done:
        advance_episode(episode, generate([dict(m) for m in episode.messages]), run_subagents)
    return episode


# --------------------------------------------------------------------------- demonstrations


class Behaviour(StrEnum):
    """Scripted orchestrators for pre-training; each is run through the real protocol."""

    PARALLEL = "parallel"
    """Assign every part at once, add the results, answer."""
    SEQUENTIAL = "sequential"
    """Calculate every part itself, add, answer (needs parts + 2 steps)."""
    PARALLEL_MISCOPY = "parallel_miscopy"
    """Split, but copy one result wrong into the sum."""
    SEQUENTIAL_MISCOPY = "sequential_miscopy"
    """Alone, and copy one result wrong into the sum."""
    SEQUENTIAL_DROP = "sequential_drop"
    """Alone, and leave one part out of the sum."""


class SubagentBehaviour(StrEnum):
    CORRECT = "correct"
    MISCOPY = "miscopy"


def scripted(problem: Problem, behaviour: Behaviour, rng: random.Random) -> Generate:
    """The orchestrator ``behaviour`` as a chat backend (it reads the tool results it is given)."""
    wrong = rng.randrange(len(problem.parts))
    results: list[int] = []

    def generate(messages: list[Message]) -> str:
        assistant = sum(m["role"] == "assistant" for m in messages)
        if assistant:
            last = messages[-1]["content"]
            results.extend(int(x) for x in last.split() if x.lstrip("-").isdigit())
        parallel = behaviour in (Behaviour.PARALLEL, Behaviour.PARALLEL_MISCOPY)
        parts = problem.part_expressions
        if parallel and assistant == 0:
            return "".join(f"{ASSIGN_OPEN}{p}{ASSIGN_CLOSE}" for p in parts)
        if not parallel and assistant < len(parts):
            return arith.format_tool_call(parts[assistant])
        if assistant == (1 if parallel else len(parts)):
            terms = [str(r) for r in results[: len(parts)]]
            if behaviour in (Behaviour.PARALLEL_MISCOPY, Behaviour.SEQUENTIAL_MISCOPY):
                terms[wrong] = str(arith._perturb_number(int(terms[wrong]), rng))
            elif behaviour is Behaviour.SEQUENTIAL_DROP:
                del terms[wrong]
            return arith.format_tool_call("+".join(terms))
        return arith.format_answer(results[-1] if results else 0)

    return generate


def scripted_subagent(behaviour: SubagentBehaviour, rng: random.Random) -> Generate:
    """A sub-agent that calls the tool on its assignment and copies (or miscopies) the result."""

    def generate(messages: list[Message]) -> str:
        if messages[-1]["role"] == "user":
            problem = arith.problem_from_text(messages[-1]["content"])
            return arith.format_tool_call(problem.expression if problem else "0+0")
        value = int(messages[-1]["content"]) if messages[-1]["content"].lstrip("-").isdigit() else 0
        if behaviour is SubagentBehaviour.MISCOPY:
            value = arith._perturb_number(value, rng)
        return arith.format_answer(value)

    return generate


def demonstration(
    problem: Problem, behaviour: Behaviour, rng: random.Random, subagent_miscopy: float = 0.0
) -> tuple[list[Message], list[list[Message]]]:
    """The orchestrator's chat showing ``behaviour`` and every sub-agent chat it spawned."""
    sub_chats: list[list[Message]] = []

    def run_subagents(assignments: list[str]) -> list[arith.Episode]:
        out = []
        for assignment in assignments:
            kind = SubagentBehaviour.MISCOPY if rng.random() < subagent_miscopy else SubagentBehaviour.CORRECT
            episode = run_subagent(assignment, scripted_subagent(kind, rng))
            sub_chats.append(episode.messages)
            out.append(episode)
        return out

    episode = run_episode(problem, scripted(problem, behaviour, rng), run_subagents)
    return episode.messages, sub_chats


MIXTURE: dict[Behaviour, float] = {
    Behaviour.PARALLEL: 0.20,
    Behaviour.SEQUENTIAL: 0.35,
    Behaviour.PARALLEL_MISCOPY: 0.10,
    Behaviour.SEQUENTIAL_MISCOPY: 0.20,
    Behaviour.SEQUENTIAL_DROP: 0.15,
}
"""Share of each orchestrator behaviour in the pre-training corpus: most work alone, a few split."""
SUBAGENT_MISCOPY = 0.05
"""Sub-agent demonstrations that miscopy (the frozen sub-agents are good, not perfect)."""


def demonstrations(n: int, rng: random.Random) -> list[list[Message]]:
    """``n`` orchestrator chats on TRAIN problems (behaviours from :data:`MIXTURE`), each followed by the chats
    of the sub-agents it spawned, so the corpus teaches both roles."""
    behaviours = list(MIXTURE)
    weights = [MIXTURE[b] for b in behaviours]
    chats: list[list[Message]] = []
    while len(chats) < n:
        problem = random_problem(rng, "train")
        main, subs = demonstration(problem, rng.choices(behaviours, weights)[0], rng, SUBAGENT_MISCOPY)
        chats.append(main)
        chats.extend(subs)
    return chats[:n]


def run_episodes(
    problems: Sequence[Problem],
    generate_batch: Callable[[list[list[Message]]], list[str]],
    subagent_batch: Callable[[list[list[Message]]], list[str]],
) -> list[Episode]:
    """Many episodes in lock step (a batched backend for orchestrators, another for sub-agents)."""
    episodes = [start_episode(p) for p in problems]

    while active := [e for e in episodes if not e.done]:
        completions = generate_batch([[dict(m) for m in e.messages] for e in active])
        pending: dict[int, list[str]] = {}
        for i, completion in enumerate(completions):
            assignments = parse_assignments(completion)
            if assignments and len(assignments) <= MAX_ASSIGNS:
                pending[i] = assignments
        flat = [a for i in pending for a in pending[i]]
        finished = iter(run_subagents_batch(flat, subagent_batch))
        for i, (episode, completion) in enumerate(zip(active, completions)):
            stage = [next(finished) for _ in pending.get(i, [])]
            advance_episode(episode, completion, lambda _assignments, s=stage: s)
    return episodes


def run_subagents_batch(
    assignments: list[str], generate_batch: Callable[[list[list[Message]]], list[str]]
) -> list[arith.Episode]:
    """Sub-agent episodes for ``assignments``, in lock step."""
    subs = [start_subagent(a) for a in assignments]
    while active := [e for e in subs if not e.done]:
        for episode, completion in zip(active, generate_batch([[dict(m) for m in e.messages] for e in active])):
            arith.advance_episode(episode, completion)
    return subs
