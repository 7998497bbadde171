"""Task verifiers: re-run a recorded session's task against a policy and compute its verifiable outcomes.

A production session that reported a verifiable outcome (``task_solved``) can be played
again against another policy when its task has a verifier: the verifier takes the session's
opening messages (its task prompt, as recorded), runs the task with a chat backend (tool calls
included) and returns the outcome values the product would have reported, by outcome name.
The trainer's replay suite scores those values with the same rule rewarding scores production
with (:func:`flywheel.task.outcome.outcome_reward`).

A session's task names its verifier by its family, the part before the first ``:``
(``arith:add`` → ``arith``). The built-in one is the calculator task's (:class:`ArithVerifier`,
whose outcome is exactly what the demo's agent reports: ``arith.Episode.success``). Others are
plug-ins of the entry-point group ``flywheel.task_verifiers`` (``name = "module:Class"``, the
name being the task family), each a :class:`Verifier` subclass instantiated without arguments.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib.metadata import entry_points
from typing import ClassVar

from flywheel.task import arith

GROUP = "flywheel.task_verifiers"
"""Entry-point group of task verifiers beyond the built-in ones."""

Message = dict[str, str]
Generate = Callable[[list[Message]], str]
"""A chat backend: the conversation so far -> the next assistant turn."""


class VerifyError(ValueError):
    """A session cannot be replayed (its prompt asks no task the verifier knows); names the session's data."""


@dataclass(frozen=True)
class ReplayCase:
    """What a replay needs of one recorded session."""

    task: str | None
    """The session's task (``arith:add``)."""
    group_key: str | None
    """The session's group key (for the calculator task, the problem id)."""
    prompt: Sequence[Message] = field(default_factory=list)
    """The opening messages as the session's first completion saw them (system, user)."""


class Verifier(ABC):
    """Replays one task family."""

    name: ClassVar[str]
    """The task family it verifies (the part of a session's task before ``:``)."""
    outcomes: ClassVar[tuple[str, ...]]
    """The outcome names :meth:`replay` reports."""

    @abstractmethod
    def replay(self, case: ReplayCase, generate: Generate) -> dict[str, float | bool]:
        """Run the session's task from its prompt with ``generate``; the outcome values by name.

        Raises :class:`VerifyError` when the case cannot be replayed.
        """


class ArithVerifier(Verifier):
    """The calculator task: the whole episode (tool calls run by the real calculator), then ``task_solved``."""

    name: ClassVar[str] = "arith"
    outcomes: ClassVar[tuple[str, ...]] = ("task_solved",)

    def __init__(self, max_turns: int = arith.DEFAULT_MAX_TURNS):
        self.max_turns = max_turns

    def problem(self, case: ReplayCase) -> arith.Problem:
        """The problem the prompt's user message asks, else the one the group key names."""
        for message in reversed(case.prompt):
            if message.get("role") == "user" and (found := arith.problem_from_text(message.get("content") or "")):
                return found
        if case.group_key:
            try:
                return arith.problem_from_id(case.group_key)
            except ValueError:
                pass
        raise VerifyError(
            f"task {case.task!r}: neither the prompt's user message nor the group key {case.group_key!r} "
            "names a calculator problem"
        )

    def replay(self, case: ReplayCase, generate: Generate) -> dict[str, float | bool]:
        """``{"task_solved": bool}`` of a new episode from the session's own opening messages."""
        problem = self.problem(case)
        prompt = [{"role": m["role"], "content": m.get("content") or ""} for m in case.prompt]
        episode = arith.run_episode(problem, generate, self.max_turns, messages=prompt or None)
        return {"task_solved": episode.success}


BUILT_IN: dict[str, type[Verifier]] = {ArithVerifier.name: ArithVerifier}


def family(task: str | None) -> str | None:
    """A task's family: the part before the first ``:`` (None for a session without a task)."""
    return task.split(":", 1)[0] if task else None


@cache
def _plugins() -> dict[str, type[Verifier]]:
    found: dict[str, type[Verifier]] = {}
    for ep in entry_points(group=GROUP):
        cls = ep.load()
        if not (isinstance(cls, type) and issubclass(cls, Verifier)):
            raise TypeError(f"task verifier {ep.name!r} ({ep.value}) is not a Verifier subclass")
        found[ep.name] = cls
    return found


def families() -> list[str]:
    """Every task family with a verifier (built-in and plug-ins)."""
    return sorted(set(BUILT_IN) | set(_plugins()))


def verifier_for(task: str | None) -> Verifier | None:
    """The verifier of a task's family, or None when there is none."""
    name = family(task)
    if name is None:
        return None
    cls = BUILT_IN.get(name) or _plugins().get(name)
    return cls() if cls is not None else None
