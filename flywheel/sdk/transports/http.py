"""HTTP transport: ``POST {gateway_url}/v1/events`` through the ingest gateway.

Body ``{"events": [<event json>, ...]}`` (the serialized events are spliced in as they
are, never re-encoded), header ``Authorization: Bearer <write key>``. The gateway's
answers and what the SDK does with them:

- 202: every event accepted.
- 422 (or 403 with the same body shape): ``rejected`` lists ``{"index", "event_id",
  "field", "reason"}`` for events refused for good; the others were accepted. Rejected
  events are logged and counted as invalid, never retried.
- 401 / 403 (a key problem): the whole batch is kept for later (the sender spools it, up
  to the spool bound) and the error is logged loudly: retrying cannot help until the
  key is fixed, so the next attempt waits :data:`AUTH_RETRY_S`.
- 413: the batch is split in halves, each sent on its own; a single event that is still
  too large is rejected.

A batch is first cut into requests of at most ``max_body_bytes`` (the gateway's
``ingest.max_body_bytes``; ``FLYWHEEL_MAX_BODY_BYTES``), sent in order, so a few large
events (a 128 k-token completion with logprobs is megabytes) never make one oversized
request; an event larger than that alone is sent alone.
- 400: the gateway could not read the body; the batch is rejected (it would never pass).
- 429, 5xx, timeouts and connection errors: retried later (``Retry-After`` honoured).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

import httpx

from flywheel.sdk.transports.base import Envelope, Rejection, SendResult, Transport, failed

log = logging.getLogger("flywheel.sdk")

EVENTS_PATH = "/v1/events"
TIMEOUT_S = 10.0
"""Timeout of one request (connect, read and write each)."""
AUTH_RETRY_S = 60.0
"""Wait before retrying after the gateway refused the write key."""
MAX_BODY_BYTES = 32 * 1024 * 1024
"""Default largest request body (the gateway's default ``ingest.max_body_bytes``)."""
BODY_FRAME_BYTES = len(b'{"events":[]}')


class AuthError(PermissionError):
    """The gateway refused the write key (401/403): not recoverable until the key is fixed."""


class HttpTransport(Transport):
    """Posts batches to the gateway at ``gateway_url`` with ``write_key``."""

    name = "http"

    def __init__(
        self,
        gateway_url: str,
        write_key: str,
        *,
        timeout_s: float = TIMEOUT_S,
        client: httpx.Client | None = None,
        max_body_bytes: int = MAX_BODY_BYTES,
    ):
        self.url = gateway_url.rstrip("/") + EVENTS_PATH
        self.max_body_bytes = max_body_bytes
        self._client = client or httpx.Client(timeout=timeout_s)
        self._headers = {
            "Authorization": f"Bearer {write_key}",
            "Content-Type": "application/json",
            "User-Agent": "flywheel-sdk",
        }

    def send(self, batch: Sequence[Envelope]) -> SendResult:
        """Post ``batch`` in requests of at most ``max_body_bytes``, in order; split a request on 413;
        never raises for a network or server failure."""
        done = SendResult()
        for start, end in body_slices(batch, self.max_body_bytes):
            part = self._post(batch[start:end], offset=start)
            done.sent += part.sent
            done.rejected += part.rejected
            if not part.ok:
                part.sent, part.rejected = done.sent, done.rejected
                return part
        return done

    def close(self, timeout_s: float = 5.0) -> None:
        """Close the connection pool."""
        self._client.close()

    # -- internals --------------------------------------------------------------------------

    def _post(self, batch: Sequence[Envelope], offset: int) -> SendResult:
        """Send ``batch`` (which starts at ``offset`` of the caller's batch); indexes are the caller's."""
        body = b'{"events":[' + b",".join(envelope.value for envelope in batch) + b"]}"
        try:
            response = self._client.post(self.url, content=body, headers=self._headers)
        except httpx.HTTPError as err:
            return failed(f"gateway {self.url} unreachable: {err!r}", retry_from=offset)
        status = response.status_code
        if status == 202:
            return SendResult(sent=len(batch))
        if status == 413:
            return self._split(batch, offset, response)
        answer = _json(response)
        if status in (422, 403) and isinstance(answer.get("rejected"), list):
            return _partial(batch, offset, answer)
        if status in (401, 403):
            detail = answer.get("detail") or response.text[:200]
            error = f"gateway refused the write key (HTTP {status}): {detail}; fix FLYWHEEL_WRITE_KEY"
            return failed(error, retry_from=offset, retry_after_s=AUTH_RETRY_S, needs_operator=True)
        if status == 400:
            reason = f"gateway could not read the batch (HTTP 400): {answer.get('detail') or response.text[:200]}"
            return SendResult(rejected=[_whole(i + offset, e, reason) for i, e in enumerate(batch)])
        if status == 429 or status >= 500:
            return failed(f"gateway answered HTTP {status}", retry_from=offset, retry_after_s=_retry_after(response))
        error = f"gateway answered HTTP {status} to {self.url}: {response.text[:200]}; check FLYWHEEL_GATEWAY_URL"
        return failed(error, retry_from=offset, retry_after_s=AUTH_RETRY_S, needs_operator=True)

    def _split(self, batch: Sequence[Envelope], offset: int, response: httpx.Response) -> SendResult:
        """413: send each half on its own; a lone event that is still too big is rejected."""
        if len(batch) == 1:
            reason = f"too large for the gateway (HTTP 413): {_json(response).get('detail') or response.text[:200]}"
            return SendResult(rejected=[_whole(offset, batch[0], reason)])
        middle = len(batch) // 2
        first = self._post(batch[:middle], offset)
        if not first.ok:
            return first
        second = self._post(batch[middle:], offset + middle)
        return SendResult(
            sent=first.sent + second.sent,
            rejected=first.rejected + second.rejected,
            retry_from=second.retry_from,
            error=second.error,
            retry_after_s=second.retry_after_s,
            needs_operator=second.needs_operator,
        )


def body_slices(batch: Sequence[Envelope], max_body_bytes: int) -> list[tuple[int, int]]:
    """``(start, end)`` of consecutive slices of ``batch`` whose request bodies stay within
    ``max_body_bytes``; an event too large for any body is a slice alone."""
    slices: list[tuple[int, int]] = []
    start, size = 0, BODY_FRAME_BYTES
    for index, envelope in enumerate(batch):
        grown = size + len(envelope.value) + (1 if index > start else 0)
        if index > start and grown > max_body_bytes:
            slices.append((start, index))
            start, grown = index, BODY_FRAME_BYTES + len(envelope.value)
        size = grown
    if start < len(batch):
        slices.append((start, len(batch)))
    return slices


def _partial(batch: Sequence[Envelope], offset: int, answer: dict[str, Any]) -> SendResult:
    """422: the listed events were rejected for good, the rest accepted."""
    rejected = []
    for item in answer["rejected"]:
        if not isinstance(item, dict):
            continue
        index = item.get("index")
        rejected.append(
            Rejection(
                index=offset + index if isinstance(index, int) else -1,
                event_id=item.get("event_id"),
                field=str(item.get("field", "")),
                reason=str(item.get("reason", "rejected")),
            )
        )
    accepted = answer.get("accepted")
    sent = len(accepted) if isinstance(accepted, list) else max(0, len(batch) - len(rejected))
    return SendResult(sent=sent, rejected=rejected)


def _whole(index: int, envelope: Envelope, reason: str) -> Rejection:
    return Rejection(index=index, event_id=_event_id(envelope), field="", reason=reason)


def _event_id(envelope: Envelope) -> str | None:
    try:
        value = json.loads(envelope.value).get("event_id")
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def _json(response: httpx.Response) -> dict[str, Any]:
    try:
        answer = response.json()
    except ValueError:
        return {}
    return answer if isinstance(answer, dict) else {}


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None
