"""``ingest.gateway.read_body``, shared by ``/v1/events``, ``/v1/traces`` and ``/v1/feedback``: each
route's refusal of an oversize body, declared or streamed, and of a Content-Length that is not a number."""

from __future__ import annotations

import asyncio

import pytest
from fastapi import HTTPException, Request

from ingest import feedback
from ingest.gateway import read_body, too_large


def request(chunks: list[bytes], content_length: str | None) -> Request:
    headers = [] if content_length is None else [(b"content-length", content_length.encode())]
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]

    async def receive() -> dict:
        return messages.pop(0)

    return Request({"type": "http", "method": "POST", "path": "/", "headers": headers}, receive)


def read(chunks: list[bytes], content_length: str | None, *args, **kwargs) -> bytes:
    return asyncio.run(read_body(request(chunks, content_length), 10, *args, **kwargs))


def test_a_body_within_the_limit_is_read_whole():
    assert read([b"abcd", b"efgh"], None) == b"abcdefgh"
    assert read([b"0123456789"], "10", feedback.too_large, check_length=False) == b"0123456789"


@pytest.mark.parametrize(
    ("refuse", "declared", "streamed", "cls"),
    [
        (too_large, "body of 11 bytes is over the limit ingest.max_body_bytes = 10",
         "body is over the limit ingest.max_body_bytes = 10", HTTPException),
        (feedback.too_large, "body of 11 bytes is over the feedback route's limit of 10",
         "body is over the feedback route's limit of 10 bytes", feedback.FeedbackError),
    ],
)  # fmt: skip
def test_each_route_refuses_an_oversize_body_in_its_own_words(refuse, declared, streamed, cls):
    with pytest.raises(cls) as err:
        read([b"x" * 11], "11", refuse)
    assert (err.value.status_code, err.value.detail) == (413, declared)
    with pytest.raises(cls) as err:
        read([b"x" * 6, b"x" * 6], None, refuse)
    assert (err.value.status_code, err.value.detail) == (413, streamed)


def test_a_content_length_that_is_not_a_number_is_400_unless_left_to_the_streamed_size():
    with pytest.raises(HTTPException) as err:
        read([b"abc"], "3x")
    assert (err.value.status_code, err.value.detail) == (400, "invalid Content-Length header")
    assert read([b"abc"], "3x", feedback.too_large, check_length=False) == b"abc"
    with pytest.raises(feedback.FeedbackError) as err:
        read([b"x" * 11], "3x", feedback.too_large, check_length=False)
    assert err.value.status_code == 413
