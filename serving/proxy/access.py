"""Who may use the router, and how fast: product keys and a token bucket per key (pure logic).

A request presents ``Authorization: Bearer <product key>`` (the ``api_key`` an agent product
gives the official ``openai`` client). The router holds every key's digest in memory
(:func:`flywheel.core.auth.key_index`, re-read with the routing table, so no request touches
the database and a revocation takes effect within ``serving.refresh_s``); :func:`check_key`
turns a header into the key it names or an :class:`AccessDenied` with its status and reason:

- 401: no key, a malformed header, an unknown key, a revoked key;
- 403: a key of another role (a gateway write key, an ops token), or a product key of a
  project this router does not serve (``serving.projects``).

Each key then draws from its own :class:`TokenBucket` (``serving.key_rate_per_s`` and
``serving.key_burst``, or the key's own ``rate_per_s`` / ``burst``): a request finding the
bucket empty gets 429 with ``Retry-After``. The buckets live in one router process; N router
processes behind a load balancer admit up to N times a key's rate.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping

from flywheel.core.auth import KeyInfo, bearer_token, hash_token
from flywheel.core.ratelimit import TokenBucket


class AccessDenied(Exception):
    """The router refuses the request (401/403/429) for ``reason``; fixed by the client, not by retrying at once."""

    def __init__(self, status: int, reason: str, code: str, retry_after_s: float | None = None):
        super().__init__(reason)
        self.status, self.reason, self.code, self.retry_after_s = status, reason, code, retry_after_s


def check_key(authorization: str | None, keys: Mapping[str, KeyInfo], projects: Collection[str]) -> KeyInfo:
    """The active product key of an ``Authorization`` header, else raise :class:`AccessDenied`.

    ``keys`` maps token digests to keys (every role, so a wrong kind of key is told so);
    ``projects`` are the projects served (empty: every project).
    """
    if authorization is None:
        raise AccessDenied(401, "missing product key: send 'Authorization: Bearer <product key>'", "missing_api_key")
    token = bearer_token(authorization)
    if token is None:
        raise AccessDenied(401, "malformed Authorization header: expected 'Bearer <product key>'", "invalid_api_key")
    info = keys.get(hash_token(token))
    if info is None:
        raise AccessDenied(401, "unknown product key", "invalid_api_key")
    if not info.active:
        raise AccessDenied(401, f"the product key {info.token_prefix}… has been revoked", "invalid_api_key")
    if info.role != "product" or not info.project:
        raise AccessDenied(
            403,
            f"a key of role {info.role} ({info.token_prefix}…) cannot call the router; use a project's product key",
            "wrong_key_role",
        )
    if projects and info.project not in projects:
        raise AccessDenied(
            403,
            f"the product key {info.token_prefix}… is scoped to project {info.project!r}; "
            f"this router serves {sorted(projects)}",
            "wrong_project",
        )
    return info


class RateLimiter:
    """A token bucket per key id, with the router's defaults or the key's own limits."""

    def __init__(self, rate_per_s: float, burst: int):
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.buckets: dict[int, TokenBucket] = {}

    def limits(self, key: KeyInfo) -> tuple[float, int]:
        """The key's ``(rate_per_s, burst)``: its own where set, else the defaults."""
        return (key.rate_per_s or self.rate_per_s, key.burst or self.burst)

    def admit(self, key: KeyInfo, now: float) -> None:
        """Take a token from the key's bucket, or raise a 429 :class:`AccessDenied` with the wait."""
        rate, burst = self.limits(key)
        bucket = self.buckets.get(key.id)
        if bucket is None:
            bucket = self.buckets[key.id] = TokenBucket.full(rate, burst, now)
        elif (bucket.rate_per_s, bucket.burst) != (rate, burst):  # the key's limits changed
            bucket.rate_per_s, bucket.burst = rate, burst
            bucket.tokens = min(bucket.tokens, float(burst))
        wait_s = bucket.take(now)
        if wait_s > 0:
            raise AccessDenied(
                429,
                f"rate limit of product key {key.token_prefix}… exceeded: {rate:g} requests/s, burst {burst}; "
                f"retry in {wait_s:.2f} s",
                "rate_limit_exceeded",
                retry_after_s=wait_s,
            )

    def forget(self, keep: Collection[int]) -> None:
        """Drop the buckets of keys not in ``keep`` (revoked or deleted)."""
        for key_id in [k for k in self.buckets if k not in keep]:
            del self.buckets[key_id]


def retry_after_header(wait_s: float) -> bytes:
    """The ``Retry-After`` value (whole seconds, at least 1) for a wait of ``wait_s``."""
    return str(max(1, math.ceil(wait_s))).encode()
