"""The calculator agent: Flywheel's synthetic, verifiable agent task.

The user asks for ``a op b`` (two-digit operands, ``op`` in ``+ - *``). The model may
call the calculator by answering with an assistant turn ``<calc>37*48</calc>``; the
agent product runs the tool and appends a ``tool`` message holding the result (or
``error: ...`` for a malformed call). The model ends the episode with an assistant
turn ``answer: 1776``. The episode succeeds when that answer equals the true result.

Pure Python (no torch): the SDK-side demo agent imports this module.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from functools import lru_cache
from typing import Literal

Op = Literal["+", "-", "*"]
Split = Literal["train", "heldout"]
Message = dict[str, str]
Generate = Callable[[list[Message]], str]
GenerateBatch = Callable[[list[list[Message]]], list[str]]

TASK_VERSION = "arith-v1"
"""Bumped whenever problems, the split or the chat protocol change."""
OPS: tuple[Op, ...] = ("+", "-", "*")
OP_KIND: dict[str, str] = {"+": "add", "-": "sub", "*": "mul"}
OPERAND_RANGE = range(10, 100)
HELDOUT_PERCENT = 20
"""Share of all problems (by id hash) that is held out for evaluation."""
DEFAULT_MAX_TURNS = 3
SYSTEM_PROMPT = "You are a calculator agent. Call <calc>a op b</calc>, then reply answer: N."
TOOL_OPEN, TOOL_CLOSE = "<calc>", "</calc>"
MAX_TOOL_DIGITS = 6
"""Largest operand (in digits) the tool accepts; longer ones are a malformed call."""

_TOOL_CALL_RE = re.compile(re.escape(TOOL_OPEN) + r"(.*?)(" + re.escape(TOOL_CLOSE) + r"|$)", re.DOTALL)
_EXPR_RE = re.compile(rf"\s*(-?\d{{1,{MAX_TOOL_DIGITS}}})\s*([+\-*])\s*(-?\d{{1,{MAX_TOOL_DIGITS}}})\s*")
_QUESTION_RE = re.compile(r"What is\s*(-?\d{1,6})\s*([+\-*])\s*(-?\d{1,6})\s*\?")
_ANSWER_RE = re.compile(r"\s*answer:\s*(-?\d{1,12})\s*", re.IGNORECASE)


@dataclass(frozen=True)
class Problem:
    """One arithmetic question. ``id`` is stable across processes and versions of Python."""

    a: int
    op: Op
    b: int

    @property
    def id(self) -> str:
        """Stable problem id, e.g. ``arith-v1:37*48``."""
        return f"{TASK_VERSION}:{self.a}{self.op}{self.b}"

    @property
    def expression(self) -> str:
        """The expression as the user and the tool write it, e.g. ``37*48``."""
        return f"{self.a}{self.op}{self.b}"

    @property
    def answer(self) -> int:
        """The true result."""
        return apply_op(self.a, self.op, self.b)

    @property
    def kind(self) -> str:
        """``add``, ``sub`` or ``mul``."""
        return OP_KIND[self.op]

    @property
    def split(self) -> Split:
        """Which split the problem belongs to (see :func:`split_of`)."""
        return split_of(self.id)

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready record of the problem."""
        return {"id": self.id, "a": self.a, "op": self.op, "b": self.b, "kind": self.kind, "answer": self.answer}


@dataclass(frozen=True)
class ToolCall:
    """A calculator call found in an assistant turn.

    ``expression`` is the raw text between the tags; ``closed`` is False when the
    closing ``</calc>`` is missing, which makes the call malformed.
    """

    expression: str
    closed: bool = True


@dataclass
class Turn:
    """One assistant turn of an episode, with the prompt it was generated from."""

    prompt: list[Message]
    completion: str
    tool_call: ToolCall | None = None
    tool_result: str | None = None

    @property
    def tool_error(self) -> bool:
        """True when this turn called the tool and the tool answered with an error."""
        return self.tool_result is not None and is_tool_error(self.tool_result)


FinishReason = Literal["answer", "no_answer", "max_turns", "running"]


@dataclass
class Episode:
    """The record of one agent episode: every message, completion and tool result."""

    problem: Problem
    messages: list[Message]
    max_turns: int = DEFAULT_MAX_TURNS
    turns: list[Turn] = field(default_factory=list)
    finish_reason: FinishReason = "running"

    @property
    def done(self) -> bool:
        """True once the episode has ended (an answer, a turn without one, or max turns)."""
        return self.finish_reason != "running"

    @property
    def final_text(self) -> str | None:
        """The last assistant completion once the episode is done."""
        return self.turns[-1].completion if self.done and self.turns else None

    @property
    def answer(self) -> int | None:
        """The parsed final answer (None if there is none)."""
        return parse_answer(self.final_text) if self.finish_reason == "answer" and self.final_text else None

    @property
    def success(self) -> bool:
        """True when the episode ended with the correct answer."""
        return self.finish_reason == "answer" and self.answer == self.problem.answer

    @property
    def tool_calls(self) -> int:
        """How many turns called the tool."""
        return sum(t.tool_call is not None for t in self.turns)

    @property
    def tool_errors(self) -> int:
        """How many tool calls were malformed."""
        return sum(t.tool_error for t in self.turns)

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready record of the episode."""
        return {
            "problem": self.problem.to_dict(),
            "messages": [dict(m) for m in self.messages],
            "turns": [
                {
                    "completion": t.completion,
                    "tool_call": asdict(t.tool_call) if t.tool_call else None,
                    "tool_result": t.tool_result,
                }
                for t in self.turns
            ],
            "finish_reason": self.finish_reason,
            "answer": self.answer,
            "success": self.success,
            "tool_calls": self.tool_calls,
            "tool_errors": self.tool_errors,
        }


# --------------------------------------------------------------------------- problems


def apply_op(a: int, op: str, b: int) -> int:
    """``a op b`` for the three supported operators."""
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    raise ValueError(f"unsupported operator {op!r}")


def split_of(problem_id: str) -> Split:
    """The split of a problem id, from a SHA-256 hash (stable across runs and machines)."""
    bucket = int.from_bytes(hashlib.sha256(problem_id.encode()).digest()[:8], "big") % 100
    return "heldout" if bucket < HELDOUT_PERCENT else "train"


@lru_cache(maxsize=2)
def all_problems(split: Split) -> tuple[Problem, ...]:
    """Every problem of a split, in a fixed order."""
    if split not in ("train", "heldout"):
        raise ValueError(f"unknown split {split!r}")
    problems = (Problem(a, op, b) for op in OPS for a in OPERAND_RANGE for b in OPERAND_RANGE)
    return tuple(p for p in problems if p.split == split)


def sample_problems(split: Split, n: int, seed: int = 0) -> list[Problem]:
    """``n`` distinct problems of ``split``, deterministic in ``seed``.

    More than the split holds is refused (ValueError), so evaluation sets never repeat.
    """
    pool = all_problems(split)
    if not 0 <= n <= len(pool):
        raise ValueError(f"n={n} outside 0..{len(pool)} (size of split {split!r})")
    return random.Random(f"{TASK_VERSION}:{split}:{seed}").sample(pool, n)


def problem_from_text(text: str) -> Problem | None:
    """The problem a user message asks (``What is 37*48?``), or None when it asks none."""
    match = _QUESTION_RE.search(text)
    if match is None:
        return None
    a, op, b = int(match.group(1)), match.group(2), int(match.group(3))
    return Problem(a, op, b)  # type: ignore[arg-type]


def problem_from_id(problem_id: str) -> Problem:
    """The problem that :attr:`Problem.id` names (inverse of ``Problem.id``)."""
    prefix, _, expr = problem_id.partition(":")
    match = _EXPR_RE.fullmatch(expr)
    if prefix != TASK_VERSION or not match:
        raise ValueError(f"not a {TASK_VERSION} problem id: {problem_id!r}")
    return Problem(int(match.group(1)), match.group(2), int(match.group(3)))  # type: ignore[arg-type]


# --------------------------------------------------------------------------- protocol


def render_messages(problem: Problem) -> list[Message]:
    """The opening chat messages of an episode (OpenAI style): system + user."""
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": f"What is {problem.expression}?"},
    ]


def format_tool_call(expression: str) -> str:
    """The assistant turn that calls the tool on ``expression``."""
    return f"{TOOL_OPEN}{expression}{TOOL_CLOSE}"


def format_answer(value: int | str) -> str:
    """The assistant turn that gives the final answer."""
    return f"answer: {value}"


def parse_tool_call(text: str) -> ToolCall | None:
    """The first ``<calc>...</calc>`` call in ``text``, or None if the text has no ``<calc>``."""
    match = _TOOL_CALL_RE.search(text)
    if match is None:
        return None
    return ToolCall(expression=match.group(1), closed=bool(match.group(2)))


def run_tool(call: ToolCall) -> str:
    """The real calculator: the result as text, or ``error: ...`` for a malformed call."""
    if not call.closed:
        return f"error: missing {TOOL_CLOSE}"
    match = _EXPR_RE.fullmatch(call.expression)
    if match is None:
        return "error: expected <calc>a op b</calc> with integers a, b and op one of + - *"
    return str(apply_op(int(match.group(1)), match.group(2), int(match.group(3))))


def is_tool_error(result: str) -> bool:
    """True when a tool result reports a malformed call."""
    return result.startswith("error:")


def parse_answer(text: str) -> int | None:
    """The integer of a final turn ``answer: N`` (the whole turn, whitespace aside), else None."""
    match = _ANSWER_RE.fullmatch(text)
    return int(match.group(1)) if match else None


def is_success(problem: Problem, final_text: str | None) -> bool:
    """True when ``final_text`` is a well-formed answer equal to the true result."""
    return final_text is not None and parse_answer(final_text) == problem.answer


# --------------------------------------------------------------------------- episodes


def start_episode(
    problem: Problem, max_turns: int = DEFAULT_MAX_TURNS, messages: Sequence[Message] | None = None
) -> Episode:
    """A new episode holding the opening messages, before any model turn.

    ``messages`` replaces the rendered opening (:func:`render_messages`) with one as recorded,
    e.g. a production session's system and user messages that the replay suite re-runs.
    """
    if max_turns < 1:
        raise ValueError("max_turns must be >= 1")
    opening = [dict(m) for m in messages] if messages is not None else render_messages(problem)
    if not opening:
        raise ValueError("an episode needs at least one opening message")
    return Episode(problem=problem, messages=opening, max_turns=max_turns)


def advance_episode(episode: Episode, completion: str) -> Episode:
    """Record one assistant ``completion`` and, for a tool call, the tool's answer.

    A turn with a ``<calc>`` call continues the episode (unless it was the last turn
    allowed); any other turn ends it, successfully or not.
    """
    if episode.done:
        raise ValueError("episode already finished")
    turn = Turn(prompt=[dict(m) for m in episode.messages], completion=completion)
    episode.turns.append(turn)
    episode.messages.append({"role": "assistant", "content": completion})
    turn.tool_call = parse_tool_call(completion)
    if turn.tool_call is None:
        episode.finish_reason = "answer" if parse_answer(completion) is not None else "no_answer"
        return episode
    turn.tool_result = run_tool(turn.tool_call)
    episode.messages.append({"role": "tool", "content": turn.tool_result})
    if len(episode.turns) >= episode.max_turns:
        episode.finish_reason = "max_turns"
    return episode


def run_episode(
    problem: Problem,
    generate: Generate,
    max_turns: int = DEFAULT_MAX_TURNS,
    messages: Sequence[Message] | None = None,
) -> Episode:
    """Run one episode; ``generate(messages) -> str`` is any chat backend.

    ``messages``: the opening messages (default: :func:`render_messages` of ``problem``).
    """
    episode = start_episode(problem, max_turns, messages)
    while not episode.done:
        advance_episode(episode, generate([dict(m) for m in episode.messages]))
    return episode


def run_episodes(
    problems: Sequence[Problem], generate_batch: GenerateBatch, max_turns: int = DEFAULT_MAX_TURNS
) -> list[Episode]:
    """Run many episodes in lock step; ``generate_batch`` answers a list of chats at once."""
    episodes = [start_episode(p, max_turns) for p in problems]
    while active := [e for e in episodes if not e.done]:
        completions = generate_batch([[dict(m) for m in e.messages] for e in active])
        if len(completions) != len(active):
            raise ValueError(f"generate_batch returned {len(completions)} completions for {len(active)} chats")
        for episode, completion in zip(active, completions):
            advance_episode(episode, completion)
    return episodes


# --------------------------------------------------------------------------- demonstrations


class Behaviour(StrEnum):
    """Ways a synthetic demonstration solves (or fails) a problem; used for pre-training."""

    CORRECT = "correct"
    """Call the tool on the right expression, copy the result."""
    GUESS = "guess"
    """Answer at once with a (wrong) guess."""
    WRONG_OPERAND = "wrong_operand"
    """Call the tool with one operand digit changed, copy that result."""
    WRONG_OP = "wrong_op"
    """Call the tool with the wrong operator, copy that result."""
    MISCOPY = "miscopy"
    """Call the tool correctly, copy the result with one digit wrong."""
    MALFORMED_RETRY = "malformed_retry"
    """A malformed call, the tool's error, then a correct call and copy."""


def demonstration(problem: Problem, behaviour: Behaviour, rng: random.Random) -> list[Message]:
    """A full chat (opening messages plus every turn) showing ``behaviour`` on ``problem``."""
    messages = render_messages(problem)

    def call(expression: str, text: str | None = None) -> str:
        completion = text if text is not None else format_tool_call(expression)
        result = run_tool(parse_tool_call(completion) or ToolCall(expression))
        messages.append({"role": "assistant", "content": completion})
        messages.append({"role": "tool", "content": result})
        return result

    def answer(value: int | str) -> None:
        messages.append({"role": "assistant", "content": format_answer(value)})

    if behaviour is Behaviour.GUESS:
        answer(_perturb_number(problem.answer, rng))
    elif behaviour is Behaviour.CORRECT:
        answer(call(problem.expression))
    elif behaviour is Behaviour.WRONG_OPERAND:
        a, b = problem.a, problem.b
        if rng.random() < 0.5:
            a = _perturb_number(a, rng, keep_digits=True)
        else:
            b = _perturb_number(b, rng, keep_digits=True)
        answer(call(f"{a}{problem.op}{b}"))
    elif behaviour is Behaviour.WRONG_OP:
        op = rng.choice([o for o in OPS if o != problem.op])
        answer(call(f"{problem.a}{op}{problem.b}"))
    elif behaviour is Behaviour.MISCOPY:
        answer(_perturb_number(int(call(problem.expression)), rng))
    elif behaviour is Behaviour.MALFORMED_RETRY:
        call("", text=_malformed_call(problem, rng))
        answer(call(problem.expression))
    else:
        raise ValueError(f"unknown behaviour {behaviour!r}")
    return messages


def _perturb_number(value: int, rng: random.Random, keep_digits: bool = False) -> int:
    """``value`` with one digit changed (never equal to ``value``; no new leading zero)."""
    digits = list(str(abs(value)))
    i = rng.randrange(len(digits))
    low = 1 if i == 0 and len(digits) > 1 else 0
    choices = [str(d) for d in range(low, 10) if str(d) != digits[i]]
    digits[i] = rng.choice(choices)
    out = int("".join(digits))
    if keep_digits and len(str(out)) != len(str(abs(value))):
        raise AssertionError("perturbation changed the digit count")
    return -out if value < 0 else out


def _malformed_call(problem: Problem, rng: random.Random) -> str:
    """A call the tool rejects: a missing operand or a missing closing tag."""
    if rng.random() < 0.5:
        return format_tool_call(f"{problem.a}{problem.op}")
    return f"{TOOL_OPEN}{problem.expression}"
