"""Named scores on the gateway's browser feedback route (``POST /v1/feedback``): built like the SDK's."""

from __future__ import annotations

import json

import pytest

from flywheel.core import feedback_tokens as ft
from flywheel.core.contracts import parse_event, uuid7
from ingest.feedback import FeedbackError, build_event, decode_body

KEY = "fwk_" + "c" * 32


def grant(**kw) -> tuple[str, ft.FeedbackGrant]:
    token = ft.mint(KEY, "demo", **kw)
    return token, ft.verify(token, ft.key_digest(KEY))


def test_a_named_score_from_a_page_is_the_sdks_event() -> None:
    cid = uuid7()
    token, g = grant(session_id="s-1", completion_id=cid, kinds=["score"])
    body = {"token": token, "kind": "score", "name": "tone", "value": "friendly", "comment": "polite"}
    event = build_event(g, decode_body(json.dumps(body).encode()))
    assert (event.session_id, event.completion_id, event.name, event.value) == ("s-1", cid, "tone", "friendly")
    assert (event.data_type, event.comment, event.score) == ("categorical", "polite", None)
    assert parse_event(event.model_dump(mode="json")) == event
    boolean = build_event(g, {"token": token, "kind": "score", "name": "correct", "value": 1, "data_type": "boolean"})
    assert boolean.value is True


@pytest.mark.parametrize(
    ("fields", "field", "words"),
    [
        ({"kind": "score", "name": "tone", "value": "x", "data_type": "numeric"}, "value", "is not numeric"),
        ({"kind": "score", "name": "tone"}, "value", "required for a named score"),
        ({"kind": "score", "value": 3}, "name", "required with value"),
        ({"kind": "score", "name": "bad name", "value": 3}, "name", "pattern"),
        ({"kind": "accept", "name": "tone", "value": 3}, "name", "only for kind 'score'"),
    ],
)
def test_bad_named_scores_are_refused_naming_the_field(fields, field, words) -> None:
    token, g = grant(session_id="s-1")
    with pytest.raises(FeedbackError) as err:
        build_event(g, {"token": token, **fields})
    assert (err.value.status_code, err.value.field) == (422, field)
    assert words in err.value.detail
