"""What trains after SDK redaction: the sample builder's rows, decoded, hold no redacted text.

The token ids are made with the project's own tokenizer (:func:`flywheel.model.tokenizer.train_tokenizer`,
trained here on a few lines), sent through the SDK with its default redactor, read back as events,
turned into the trainer's rows by :func:`rewarding.samples.build_samples` and decoded again.
"""

from __future__ import annotations

import pytest

from flywheel.model.tokenizer import train_tokenizer
from flywheel.sdk import Flywheel
from flywheel.sdk.transports.memory import MemoryTransport
from rewarding.composite import combine
from rewarding.extractors.base import Components
from rewarding.samples import build_samples
from rewarding.session_state import Session

SECRETS = ("boss@acme.com", "sk-abcdefghijklmnopqrstuvwxyz012345")
CORPUS = [
    "what is two plus two? four. write to boss@acme.com with the key sk-abcdefghijklmnopqrstuvwxyz012345",
    'send {"to": "boss@acme.com"} ok done the answer is',
] * 20


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(CORPUS, vocab_size=320)


def _log(tokenizer, *, redact: bool, tmp_path) -> tuple[Flywheel, Session]:
    transport = MemoryTransport()
    fw = Flywheel(project="redact-train", transport=transport, spool_dir=tmp_path, redact=redact)
    cases = [
        ("clean", "what is two plus two?", "four", None),
        ("completion", "what is two plus two?", "write to boss@acme.com", None),
        ("prompt", "my key is sk-abcdefghijklmnopqrstuvwxyz012345", "ok done", None),
        ("tool_call", "what is two plus two?", "", '{"to": "boss@acme.com"}'),
    ]
    with fw.session() as s:
        for _, prompt, completion, arguments in cases:
            messages = [{"role": "user", "content": prompt}]
            rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            prompt_ids = tokenizer.encode(rendered, add_special_tokens=False)
            completion_ids = tokenizer.encode(completion + (arguments or ""), add_special_tokens=False)
            s.completion(
                model="m",
                prompt_messages=messages,
                completion_text=completion,
                tool_calls=[{"id": "c1", "name": "send", "arguments": arguments}] if arguments else None,
                prompt_token_ids=prompt_ids,
                completion_token_ids=completion_ids,
                logprobs=[-0.5] * len(completion_ids),
                sampling={"temperature": 1.0},
            )
    assert fw.flush(10)
    fw.close()
    events = transport.events()
    return fw, Session.from_events("redact-train", events[0].session_id, events)


def _decoded_rows(tokenizer, session: Session) -> tuple[list[str], dict[str, int]]:
    composite = combine({"outcome": Components(value=1.0)}, {"outcome": 1.0})
    rows, skipped = build_samples(session, composite, ["agent"])
    return [tokenizer.decode(r.prompt_token_ids + r.completion_token_ids) for r in rows], dict(skipped)


def test_no_redacted_string_survives_in_the_trainers_samples(tokenizer, tmp_path) -> None:
    fw, session = _log(tokenizer, redact=True, tmp_path=tmp_path)
    decoded, skipped = _decoded_rows(tokenizer, session)
    assert len(decoded) == 1 and "four" in decoded[0]  # only the clean completion trains
    for text in decoded:
        for secret in SECRETS:
            assert secret not in text
    # excluded by the sample builder under its existing reasons, not crashed on, not re-tokenised
    assert skipped == {"no_completion_token_ids": 2, "no_prompt_token_ids": 1}
    assert fw.stats.token_data_redacted == 3


def test_without_redaction_the_secrets_would_train(tokenizer, tmp_path) -> None:
    """The control: the decode above does find the secrets when token data is sent as it was."""
    fw, session = _log(tokenizer, redact=False, tmp_path=tmp_path)
    decoded, skipped = _decoded_rows(tokenizer, session)
    assert len(decoded) == 4 and not skipped
    joined = "\n".join(decoded)
    assert all(secret in joined for secret in SECRETS)
    assert fw.stats.token_data_redacted == 0
