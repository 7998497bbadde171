"""The generic chat agent's partial credit (``make bench-byo``): right answers score 1, anything else less,
and replies that get closer score more, so a model that solves nothing still has a reward with signal."""

from __future__ import annotations

from flywheel.demo.chat_agent import REWARD_RULES, Sampling, partial_credit, question, served_version
from flywheel.task import arith

PROBLEM = arith.Problem(37, "*", 48)  # 1776


def test_the_right_number_first_scores_one_and_nothing_else_does() -> None:
    assert partial_credit(PROBLEM, "1776") == 1.0
    assert partial_credit(PROBLEM, " 1776 is the answer, not 12") == 1.0
    assert partial_credit(PROBLEM, "12 or 1776") < 1.0
    assert partial_credit(PROBLEM, "1767") < 1.0
    assert partial_credit(arith.Problem(10, "-", 30), "-20") == 1.0


def test_partial_credit_orders_replies_by_how_close_they_are() -> None:
    nothing = partial_credit(PROBLEM, "hello there")
    far = partial_credit(PROBLEM, "5")
    same_digits = partial_credit(PROBLEM, "6771")
    close = partial_credit(PROBLEM, "1767")
    assert nothing == 0.0
    assert 0.0 < far < same_digits < close < 1.0
    assert all(0.0 <= partial_credit(PROBLEM, text) <= 0.9 for text in ("", "-99999999", "17761776", "6771"))


def test_the_request_samples_as_the_issue_says_and_asks_in_one_user_turn() -> None:
    request = Sampling().request()
    assert (request["temperature"], request["top_p"], request["extra_body"]) == (0.7, 0.9, {"top_k": 50})
    assert request["max_tokens"] <= 32
    [turn] = question(PROBLEM)
    assert turn["role"] == "user" and "37 * 48" in turn["content"]
    assert REWARD_RULES["task_score"]["kind"] == "linear"


def test_the_served_version_is_read_from_the_routers_body_member() -> None:
    class Response:
        flywheel = {"policy_version": "c000003-abcdef12", "replica": "3"}

    assert served_version(Response()) == "c000003-abcdef12"
    assert served_version(object()) is None
