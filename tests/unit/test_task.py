"""The calculator task: parsing, the tool, success checks, the split, the episode loop."""

from __future__ import annotations

import random

import pytest

from flywheel.task import arith
from flywheel.task.arith import Behaviour, Problem, ToolCall


def test_problem_fields_and_stable_id() -> None:
    p = Problem(37, "*", 48)
    assert p.id == "arith-v1:37*48"
    assert p.answer == 1776 and p.kind == "mul" and p.expression == "37*48"
    assert arith.problem_from_id(p.id) == p
    assert Problem(12, "-", 98).answer == -86
    assert p.to_dict()["answer"] == 1776


def test_problem_from_id_rejects_other_ids() -> None:
    with pytest.raises(ValueError):
        arith.problem_from_id("arith-v0:1+2")
    with pytest.raises(ValueError):
        arith.problem_from_id("arith-v1:1/2")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<calc>37*48</calc>", ToolCall("37*48", True)),
        ("let me see <calc> 12 - 5 </calc> ok", ToolCall(" 12 - 5 ", True)),
        ("<calc>37*48", ToolCall("37*48", False)),
        ("<calc>1+1</calc><calc>2+2</calc>", ToolCall("1+1", True)),
        ("answer: 12", None),
        ("", None),
    ],
)
def test_parse_tool_call(text: str, expected: ToolCall | None) -> None:
    assert arith.parse_tool_call(text) == expected


@pytest.mark.parametrize(
    ("expression", "result"),
    [("37*48", "1776"), (" 12 - 98 ", "-86"), ("10+99", "109"), ("-5*-5", "25")],
)
def test_run_tool_computes(expression: str, result: str) -> None:
    assert arith.run_tool(ToolCall(expression)) == result


@pytest.mark.parametrize("expression", ["37*", "", "3/4", "a+b", "1+2+3", "1234567*2"])
def test_run_tool_malformed_is_an_error(expression: str) -> None:
    out = arith.run_tool(ToolCall(expression))
    assert out.startswith("error:") and arith.is_tool_error(out)


def test_run_tool_unclosed_call_is_an_error() -> None:
    assert arith.is_tool_error(arith.run_tool(ToolCall("1+2", closed=False)))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("answer: 1776", 1776),
        ("  Answer:-86 ", -86),
        ("answer:  0", 0),
        ("answer: 17 76", None),
        ("the answer: 5", None),
        ("answer: 5 answer: 6", None),
        ("answer:", None),
        ("1776", None),
    ],
)
def test_parse_answer(text: str, expected: int | None) -> None:
    assert arith.parse_answer(text) == expected


def test_is_success() -> None:
    p = Problem(37, "*", 48)
    assert arith.is_success(p, "answer: 1776")
    assert not arith.is_success(p, "answer: 1777")
    assert not arith.is_success(p, "<calc>37*48</calc>")
    assert not arith.is_success(p, None)


def test_render_messages() -> None:
    messages = arith.render_messages(Problem(37, "*", 48))
    assert [m["role"] for m in messages] == ["system", "user"]
    assert messages[1]["content"] == "What is 37*48?"
    assert "<calc>" in messages[0]["content"]


def test_split_is_deterministic_disjoint_and_covers_everything() -> None:
    train, heldout = arith.all_problems("train"), arith.all_problems("heldout")
    assert not set(train) & set(heldout)
    assert len(train) + len(heldout) == 3 * 90 * 90
    assert 0.15 < len(heldout) / (len(train) + len(heldout)) < 0.25
    assert all(arith.split_of(p.id) == "heldout" for p in heldout[:200])
    assert all(arith.split_of(p.id) == "train" for p in train[:200])
    # SHA-256 of the id, not Python's salted hash(): the same on every run and machine
    pinned = {"37*48": "heldout", "10+10": "train", "99-99": "heldout", "12*34": "train", "13-21": "heldout"}
    assert {e: arith.split_of(f"arith-v1:{e}") for e in pinned} == pinned


def test_sample_problems_deterministic_and_within_split() -> None:
    a = arith.sample_problems("heldout", 100, seed=3)
    assert a == arith.sample_problems("heldout", 100, seed=3)
    assert a != arith.sample_problems("heldout", 100, seed=4)
    assert len(set(a)) == 100
    assert all(p.split == "heldout" for p in a)
    assert all(p.split == "train" for p in arith.sample_problems("train", 100, seed=3))
    assert {p.kind for p in a} == {"add", "sub", "mul"}


def test_sample_problems_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        arith.sample_problems("heldout", 10**6)
    with pytest.raises(ValueError):
        arith.sample_problems("test", 1)  # type: ignore[arg-type]


def scripted(*completions: str) -> arith.Generate:
    """A generate function that answers with the given completions in order."""
    queue = list(completions)
    seen: list[list[arith.Message]] = []

    def generate(messages: list[arith.Message]) -> str:
        seen.append(messages)
        return queue.pop(0)

    generate.seen = seen  # type: ignore[attr-defined]
    return generate


def test_episode_with_tool_call_succeeds() -> None:
    p = Problem(37, "*", 48)
    generate = scripted("<calc>37*48</calc>", "answer: 1776")
    ep = arith.run_episode(p, generate)
    assert ep.success and ep.finish_reason == "answer" and ep.answer == 1776
    assert [m["role"] for m in ep.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert ep.messages[3]["content"] == "1776"
    assert ep.tool_calls == 1 and ep.tool_errors == 0
    assert ep.turns[0].tool_result == "1776" and ep.turns[1].tool_call is None
    # the second prompt already holds the tool result; prompts are snapshots
    assert generate.seen[1][-1] == {"role": "tool", "content": "1776"}  # type: ignore[attr-defined]
    assert len(ep.turns[0].prompt) == 2 and len(ep.turns[1].prompt) == 4
    assert ep.to_dict()["success"] is True


def test_episode_direct_wrong_answer_fails() -> None:
    ep = arith.run_episode(Problem(37, "*", 48), scripted("answer: 1700"))
    assert not ep.success and ep.finish_reason == "answer" and ep.answer == 1700 and ep.tool_calls == 0


def test_episode_without_answer_ends() -> None:
    ep = arith.run_episode(Problem(37, "*", 48), scripted("I am not sure"))
    assert not ep.success and ep.finish_reason == "no_answer" and ep.answer is None


def test_episode_tool_error_then_retry() -> None:
    ep = arith.run_episode(Problem(37, "*", 48), scripted("<calc>37*</calc>", "<calc>37*48</calc>", "answer: 1776"))
    assert ep.success and ep.tool_calls == 2 and ep.tool_errors == 1
    assert ep.turns[0].tool_error and arith.is_tool_error(ep.messages[3]["content"])


def test_episode_stops_at_max_turns() -> None:
    ep = arith.run_episode(Problem(1, "+", 2), scripted(*["<calc>1+2</calc>"] * 5), max_turns=3)
    assert ep.finish_reason == "max_turns" and len(ep.turns) == 3 and not ep.success
    with pytest.raises(ValueError):
        arith.advance_episode(ep, "answer: 3")


def test_run_episodes_batches_in_lock_step() -> None:
    problems = [Problem(11, "+", 22), Problem(30, "-", 40), Problem(12, "*", 12)]
    calls: list[int] = []

    def generate_batch(chats: list[list[arith.Message]]) -> list[str]:
        calls.append(len(chats))
        out = []
        for chat in chats:
            p = arith.problem_from_id(f"{arith.TASK_VERSION}:{chat[1]['content'][8:-1]}")
            if chat[-1]["role"] == "tool":
                out.append(f"answer: {chat[-1]['content']}")
            elif p.op == "+":
                out.append("answer: 0")
            else:
                out.append(f"<calc>{p.expression}</calc>")
        return out

    episodes = arith.run_episodes(problems, generate_batch)
    assert calls == [3, 2]
    assert [e.success for e in episodes] == [False, True, True]


def test_demonstrations_follow_the_protocol() -> None:
    rng = random.Random(0)
    for p in arith.sample_problems("train", 30, seed=1):
        for behaviour in Behaviour:
            chat = arith.demonstration(p, behaviour, rng)
            assistant = [m["content"] for m in chat if m["role"] == "assistant"]
            replay = arith.run_episode(p, scripted(*assistant))
            assert replay.messages == chat
            assert replay.success == (behaviour in (Behaviour.CORRECT, Behaviour.MALFORMED_RETRY))
            assert (replay.tool_errors > 0) == (behaviour is Behaviour.MALFORMED_RETRY)
