"""PII redaction: the default redactor, the walk over an event's fields, the product's hook."""

from __future__ import annotations

import random
import re

import pytest

from flywheel.sdk import Flywheel
from flywheel.sdk.redact import _PATTERNS, Redactor, chain, luhn_ok, redact_completion, redact_fields
from flywheel.sdk.transports.memory import MemoryTransport

redact = Redactor()


@pytest.mark.parametrize(
    ("text", "secret"),
    [
        ("write to john.doe+ops@mail.example.co.uk today", "john.doe+ops@mail.example.co.uk"),
        ("OPENAI_API_KEY is sk-proj-abcdefghijklmnopqrstuvwxyz012345", "sk-proj-abcdefghijklmnopqrstuvwxyz012345"),
        ("token ghp_abcdefghijklmnopqrstuvwxyz0123456789", "ghp_abcdefghijklmnopqrstuvwxyz0123456789"),
        ("aws AKIAIOSFODNN7EXAMPLE key", "AKIAIOSFODNN7EXAMPLE"),
        ("slack xoxb-123456789012-abcdefABCDEF", "xoxb-123456789012-abcdefABCDEF"),
        ("flywheel key fwk_AbCdEfGhIjKlMnOpQrStUvWxYz012345", "fwk_AbCdEfGhIjKlMnOpQrStUvWxYz012345"),
        ("product key fwp_AbCdEfGhIjKlMnOpQrStUvWxYz012345", "fwp_AbCdEfGhIjKlMnOpQrStUvWxYz012345"),
        ("Authorization: Bearer abc.def-ghi_jkl~mno+pqr", "abc.def-ghi_jkl~mno+pqr"),
        (
            "jwt eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U",
            "eyJhbGci",
        ),
        ("password=hunter2hunter2 and more", "hunter2hunter2"),
        ('{"api_key": "k-1234567890"}', "k-1234567890"),
        ("card 4111 1111 1111 1111 exp 12/29", "4111 1111 1111 1111"),
        ("card 5500-0000-0000-0004", "5500-0000-0000-0004"),
        ("-----BEGIN RSA PRIVATE KEY-----\nMIIEow\n-----END RSA PRIVATE KEY-----", "MIIEow"),
    ],
)
def test_default_redactor_removes_secrets(text: str, secret: str) -> None:
    out = redact(text)
    assert secret not in out
    assert "[REDACTED_" in out


@pytest.mark.parametrize(
    "text",
    [
        "the build took 1700000000000 ms",  # 13 digits, fails Luhn
        "order 4111111111111112 is not a card",  # Luhn fails
        "call me at 2024-01-01 12:00",
        "plain prose with an @ sign and user@localhost",
        "token ids 12 345 6789",
    ],
)
def test_default_redactor_keeps_ordinary_text(text: str) -> None:
    assert redact(text) == text


PIECES = [
    "a@b.io", "x.y+z@mail.example.co.uk", "sk-proj-abcdefghijklmnopqrstuvwxyz012345", "gh",
    "ghp_abcdefghijklmnopqrstuvwxyz0123", "AKIAIOSFODNN7EXAMPLE", "AIzaSyA-abcdefghijklmnopqrstuvwxyz01234",
    "xoxb-123456789012-abc", "fwk_AbCdEfGhIjKlMnOpQrStUvWx", "fwp_AbCdEfGhIjKlMnOpQrStUvWx",
    "Bearer abc.def-ghi_jkl~mno", "BEARER abcdefghijklmnop",
    "eyJhbGciOiJI.eyJzdWIiOiIx.dozjgNryP4J3", "password=hunter2hunter2", 'API_KEY: "abcdefgh"', "TOKEN=xyzxyzxyz",
    "pAsSwOrD = 'qwertyuiop'", "4111 1111 1111 1111", "5500-0000-0000-0004", "4111111111111112", "-4111111111111111",
    "1700000000000", "-----BEGIN RSA PRIVATE KEY-----\nMIIE\n-----END RSA PRIVATE KEY-----", " ", "-", "_", "1", "@",
    ":", "=", "\n", "eyJ", "sk-", "12 34", "lorem ipsum ", "é", "ſecret=abcdefgh", "\u212a", "\u0663" * 13, "\u0130",
    "apı_key=abcdefgh",
]  # fmt: skip


def test_skipping_patterns_that_cannot_match_changes_nothing() -> None:
    """The substring gates only skip work: the result equals one pass of the full original alternation."""
    original = [(label, regex) for label, regex in _PATTERNS]
    original[-1] = ("CARD", r"(?<![\d-])\d(?:[ -]?\d){12,18}(?![\d-])")  # as first written, lookbehind first
    full = re.compile("|".join(f"(?P<g{i}>{regex})" for i, (_, regex) in enumerate(original)))
    rng = random.Random(7)
    changed = 0
    for _ in range(5000):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 8)))
        expected = full.sub(redact._replace, text)
        assert redact(text) == expected, text
        changed += expected != text
    assert changed > 2000  # the pieces do trigger the patterns


def test_plain_prose_skips_the_regex() -> None:
    text = "lorem ipsum dolor sit amet " * 40
    assert redact._regex_for(0) is None
    assert redact(text) is text


def test_luhn() -> None:
    assert luhn_ok("4111111111111111")
    assert not luhn_ok("4111111111111112")


def test_extra_patterns_and_chain() -> None:
    custom = Redactor(extra=[("TICKET", r"\bTICKET-\d+\b")])
    assert custom("see TICKET-991 from a@b.io") == "see [REDACTED_TICKET] from [REDACTED_EMAIL]"
    both = chain(redact, lambda text: text.replace("Acme", "[CUSTOMER]"))
    assert both is not None and both("Acme: a@b.io") == "[CUSTOMER]: [REDACTED_EMAIL]"
    assert chain(None, None) is None


def test_redact_fields_touches_free_text_only() -> None:
    fields = {
        "span": {"span_id": "a@b.io", "role": "agent"},
        "messages": [{"role": "user", "content": "mail a@b.io", "name": "x@y.io"}],
        "tool_calls": [{"id": "c1", "name": "send", "arguments": '{"to": "c@d.io"}'}],
        "tool_results": [{"tool_call_id": "c1", "content": "sent to c@d.io"}],
        "metadata": {"contact": "e@f.io", "n": 3},
        "user_id": "g@h.io",
    }
    redact_fields(fields, redact)
    assert fields["messages"][0]["content"] == "mail [REDACTED_EMAIL]"
    assert fields["tool_calls"][0]["arguments"] == '{"to": "[REDACTED_EMAIL]"}'
    assert fields["tool_results"][0]["content"] == "sent to [REDACTED_EMAIL]"
    assert fields["metadata"] == {"contact": "[REDACTED_EMAIL]", "n": 3}
    # ids and names are not free text
    assert fields["span"]["span_id"] == "a@b.io"
    assert fields["messages"][0]["name"] == "x@y.io"
    assert fields["user_id"] == "g@h.io"


def _client(tmp_path, **kw) -> tuple[Flywheel, MemoryTransport]:
    transport = MemoryTransport()
    return Flywheel(project="redact", transport=transport, spool_dir=tmp_path, **kw), transport


def test_nothing_unredacted_reaches_the_transport(tmp_path) -> None:
    fw, transport = _client(tmp_path, redactor=lambda text: text.replace("ACME-CORP", "[CUSTOMER]"))
    with fw.session(metadata={"email": "boss@acme.com"}) as s:
        s.message("user", "I am boss@acme.com from ACME-CORP, card 4111111111111111")
        call = s.tool_call("lookup", {"email": "boss@acme.com"})
        s.tool_result(call, "key sk-abcdefghijklmnopqrstuvwx")
        s.completion(model="m", completion_text="write to boss@acme.com", prompt_text="ACME-CORP")
    fw.feedback(s.session_id, "follow_up", text="no, boss@acme.com!")
    assert fw.flush(10)
    fw.close()
    wire = b"".join(e.value for e in transport.envelopes)
    for secret in (b"boss@acme.com", b"ACME-CORP", b"4111111111111111", b"sk-abcdefghijklmnopqrstuvwx"):
        assert secret not in wire
    assert b"[CUSTOMER]" in wire and b"[REDACTED_EMAIL]" in wire
    assert fw.stats.sent == 7


def test_redact_false_keeps_text_and_a_failing_hook_never_leaks(tmp_path) -> None:
    fw, transport = _client(tmp_path, redact=False)
    fw.session().message("user", "a@b.io")
    assert fw.flush(10)
    fw.close()
    assert b"a@b.io" in transport.envelopes[-1].value

    def broken(text: str) -> str:
        raise RuntimeError("redactor bug")

    fw, transport = _client(tmp_path, redactor=broken)
    fw.session().message("user", "a@b.io")  # must not raise here
    assert fw.flush(10)
    fw.close()
    assert [e.type for e in transport.events()] == ["session_start"]  # it has no free text to redact
    assert fw.stats.invalid == 1  # the message is not sent unredacted


def _completion_fields(**kw) -> dict:
    fields = {
        "model": "m",
        "policy_version": "v1",
        "prompt_messages": [{"role": "user", "content": "what is two plus two"}],
        "completion_text": "four",
        "tool_calls": [{"id": "c1", "name": "calc", "arguments": '{"x": 2}'}],
        "prompt_token_ids": [1, 2, 3],
        "completion_token_ids": [4, 5],
        "logprobs": [-0.5, -0.25],
    }
    fields.update(kw)
    return fields


@pytest.mark.parametrize(
    ("changed", "gone"),
    [
        ({"completion_text": "mail boss@acme.com"}, {"completion_token_ids", "logprobs"}),
        (
            {"tool_calls": [{"id": "c1", "name": "send", "arguments": '{"to": "boss@acme.com"}'}]},
            {"completion_token_ids", "logprobs"},
        ),
        ({"prompt_messages": [{"role": "user", "content": "I am boss@acme.com"}]}, {"prompt_token_ids"}),
        ({"prompt_messages": [], "prompt_text": "key sk-abcdefghijklmnopqrstuvwx"}, {"prompt_token_ids"}),
        (
            {"completion_text": "a@b.io", "prompt_text": "c@d.io"},
            {"prompt_token_ids", "completion_token_ids", "logprobs"},
        ),
        ({}, set()),
    ],
)
def test_redaction_drops_the_token_data_of_changed_text(changed: dict, gone: set) -> None:
    fields = _completion_fields(**changed)
    assert redact_completion(fields, redact) == bool(gone)
    assert {"prompt_token_ids", "completion_token_ids", "logprobs"} - fields.keys() == gone
    for key in {"prompt_token_ids", "completion_token_ids", "logprobs"} - gone:
        assert fields[key] == _completion_fields()[key]  # what stays is untouched
    assert "acme.com" not in repr(fields)


def test_a_redactor_that_changes_nothing_keeps_the_token_data() -> None:
    fields = _completion_fields(completion_text="mail boss@acme.com", prompt_text="boss@acme.com")
    assert not redact_completion(fields, lambda text: "".join(list(text)))  # equal strings, new objects
    assert fields == _completion_fields(completion_text="mail boss@acme.com", prompt_text="boss@acme.com")
    # a change nested in a message is a change
    fields = _completion_fields(prompt_messages=[{"role": "user", "content": "ACME-CORP"}])
    assert redact_completion(fields, lambda text: text.replace("ACME-CORP", "[CUSTOMER]"))
    assert "prompt_token_ids" not in fields and fields["completion_token_ids"] == [4, 5]


def test_no_token_data_nothing_dropped() -> None:
    fields = _completion_fields(completion_text="mail boss@acme.com")
    del fields["completion_token_ids"], fields["logprobs"]
    assert not redact_completion(fields, redact)  # nothing to drop: not counted
    assert fields["prompt_token_ids"] == [1, 2, 3] and fields["completion_text"] == "mail [REDACTED_EMAIL]"


def test_the_client_sends_redacted_completions_without_their_token_data(tmp_path) -> None:
    fw, transport = _client(tmp_path, redactor=lambda text: text.replace("ACME-CORP", "[CUSTOMER]"))
    with fw.session() as s:
        secret = s.completion(
            model="m",
            completion_text="write to boss@acme.com",
            prompt_text="hi",
            prompt_token_ids=[1, 2],
            completion_token_ids=[3, 4],
            logprobs=[-1.0, -2.0],
        )
        prompt = s.completion(
            model="m",
            completion_text="ok",
            prompt_text="from ACME-CORP",
            prompt_token_ids=[1, 2],
            completion_token_ids=[3, 4],
            logprobs=[-1.0, -2.0],
        )
        clean = s.completion(
            model="m",
            completion_text="ok",
            prompt_text="hi",
            prompt_token_ids=[1, 2],
            completion_token_ids=[3, 4],
            logprobs=[-1.0, -2.0],
        )
    assert fw.flush(10)
    fw.close()
    sent = {e.completion_id: e for e in transport.events() if e.type == "completion"}
    assert sent[secret].completion_token_ids is None and sent[secret].logprobs is None
    assert sent[secret].prompt_token_ids == [1, 2] and sent[secret].completion_text == "write to [REDACTED_EMAIL]"
    assert sent[prompt].prompt_token_ids is None and sent[prompt].completion_token_ids == [3, 4]
    assert sent[prompt].logprobs == [-1.0, -2.0]
    assert (sent[clean].prompt_token_ids, sent[clean].completion_token_ids) == ([1, 2], [3, 4])
    assert fw.stats.token_data_redacted == 2 and fw.stats.invalid == 0


def test_without_redaction_token_data_is_kept(tmp_path) -> None:
    fw, transport = _client(tmp_path, redact=False)
    fw.session().completion(
        model="m",
        completion_text="boss@acme.com",
        prompt_text="boss@acme.com",
        prompt_token_ids=[1],
        completion_token_ids=[2],
        logprobs=[-1.0],
    )
    assert fw.flush(10)
    fw.close()
    (event,) = [e for e in transport.events() if e.type == "completion"]
    assert (event.prompt_token_ids, event.completion_token_ids, event.logprobs) == ([1], [2], [-1.0])
    assert fw.stats.token_data_redacted == 0
