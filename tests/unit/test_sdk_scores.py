"""``fw.score`` and ``Session.score``: named scores through the SDK, targeted like feedback."""

from __future__ import annotations

import uuid

import pytest

from flywheel.core.contracts import Feedback
from flywheel.sdk import Flywheel
from flywheel.sdk.transports.memory import MemoryTransport


@pytest.fixture
def fw(tmp_path):
    client = Flywheel(project="score-test", transport=MemoryTransport(), spool_dir=tmp_path)
    yield client
    client.close(2)


def scores(fw: Flywheel) -> list[Feedback]:
    assert fw.flush(10)
    return [e for e in fw.transport.events() if isinstance(e, Feedback)]  # type: ignore[attr-defined]


def test_scores_on_sessions_and_completions(fw: Flywheel) -> None:
    with fw.session() as s:
        cid = s.completion(model="m", completion_text="patch")
    fw.score(s, "helpfulness", 0.8, comment="mostly right")
    fw.score(cid, "correct", True)  # a completion this process logged: its session is known
    s.score("tone", "friendly", completion_id=cid)
    fw.score("s-elsewhere", "correct", 1, data_type="boolean", user_id="u-1")
    other = uuid.uuid4()
    fw.score(other, "stars", 4, session_id="s-elsewhere")  # from another process: session given
    got = [(e.session_id, e.completion_id, e.kind.value, e.name, e.value, e.data_type, e.comment) for e in scores(fw)]
    assert got == [
        (s.session_id, None, "score", "helpfulness", 0.8, "numeric", "mostly right"),
        (s.session_id, cid, "score", "correct", True, "boolean", None),
        (s.session_id, cid, "score", "tone", "friendly", "categorical", None),
        ("s-elsewhere", None, "score", "correct", True, "boolean", None),
        ("s-elsewhere", other, "score", "stars", 4, "numeric", None),
    ]
    assert fw.stats.invalid == 0


def test_a_score_by_completion_id_alone_is_sent_unattached(tmp_path) -> None:
    with Flywheel(project="score-test", transport=MemoryTransport(), spool_dir=tmp_path / "a") as first:
        with first.session() as s:
            cid = s.completion(model="m", completion_text="x")
    with Flywheel(project="score-test", transport=MemoryTransport(), spool_dir=tmp_path / "b") as later:
        assert later.score(cid, "correct", False) is not None
        (event,) = scores(later)
        assert (event.session_id, event.completion_id, event.value, event.attached) == (None, cid, False, False)


def test_bad_scores_are_counted_never_raised(fw: Flywheel, caplog: pytest.LogCaptureFixture) -> None:
    with fw.session() as s:
        pass
    fw.score(s, "tone", "good", data_type="numeric")
    fw.score(s, "bad name", 1)
    fw.score(s, "ok", 2, data_type="boolean")
    s.score("fine", 0.5)
    got = scores(fw)
    assert [(e.name, e.value) for e in got] == [("fine", 0.5)]
    assert fw.stats.invalid == 3
    assert any("value" in r.getMessage() and "is not numeric" in r.getMessage() for r in caplog.records)


def test_the_comment_is_redacted(tmp_path) -> None:
    with Flywheel(project="score-test", transport=MemoryTransport(), spool_dir=tmp_path) as fw:
        fw.score("s-1", "tone", "rude", comment="mail me at jane@example.com")
        (event,) = scores(fw)
    assert event.comment == "mail me at [REDACTED_EMAIL]"
