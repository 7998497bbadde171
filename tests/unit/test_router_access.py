"""The router's key check and its token bucket per key (pure logic: time is passed in)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from flywheel.core.auth import KeyInfo, create_key, hash_token
from serving.proxy.access import AccessDenied, RateLimiter, TokenBucket, check_key, retry_after_header

PRODUCT = "fwp_" + "p" * 32
WRITER = "fwk_" + "w" * 32
REVOKED = "fwp_" + "r" * 32
KEYS = {
    hash_token(PRODUCT): KeyInfo(1, "agent", "product", "shop", PRODUCT[:12]),
    hash_token(WRITER): KeyInfo(2, "ingest", "writer", "shop", WRITER[:12]),
    hash_token(REVOKED): KeyInfo(3, "old", "product", "shop", REVOKED[:12], revoked_at=datetime.now(UTC)),
}


def denied(authorization: str | None, projects: tuple[str, ...] = ()) -> AccessDenied:
    with pytest.raises(AccessDenied) as caught:
        check_key(authorization, KEYS, projects)
    return caught.value


def test_a_product_key_of_a_served_project_passes() -> None:
    assert check_key(f"Bearer {PRODUCT}", KEYS, ()).id == 1
    assert check_key(f"bearer {PRODUCT}", KEYS, ("shop", "other")).project == "shop"


def test_each_refusal_has_its_status_and_reason() -> None:
    missing = denied(None)
    assert (missing.status, missing.code) == (401, "missing_api_key") and "Bearer" in missing.reason
    assert denied("Basic abc").status == 401 and "malformed" in denied("Basic abc").reason
    assert (denied("Bearer fwp_nope").status, denied("Bearer fwp_nope").reason) == (401, "unknown product key")
    revoked = denied(f"Bearer {REVOKED}")
    assert revoked.status == 401 and "revoked" in revoked.reason
    writer = denied(f"Bearer {WRITER}")
    assert writer.status == 403 and "role writer" in writer.reason and writer.code == "wrong_key_role"
    other = denied(f"Bearer {PRODUCT}", ("billing",))
    assert other.status == 403 and "'shop'" in other.reason and "billing" in other.reason


def test_the_bucket_grants_its_burst_then_one_per_refill() -> None:
    bucket = TokenBucket.full(rate_per_s=2.0, burst=3, now=100.0)
    assert [bucket.take(100.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take(100.0) == pytest.approx(0.5)  # one token comes in 1 / rate seconds
    assert bucket.take(100.25) == pytest.approx(0.25)  # a refused request takes nothing
    assert bucket.take(100.5) == 0.0
    assert bucket.take(100.5) == pytest.approx(0.5)
    assert bucket.take(200.0) == 0.0 and bucket.tokens == pytest.approx(2.0)  # refill stops at the burst


def test_the_bucket_ignores_a_clock_that_goes_back() -> None:
    bucket = TokenBucket.full(rate_per_s=1.0, burst=1, now=10.0)
    assert bucket.take(10.0) == 0.0
    assert bucket.take(5.0) == pytest.approx(1.0)  # no tokens from negative time
    assert bucket.take(11.0) == 0.0


def test_the_limiter_keeps_one_bucket_per_key_and_says_when_to_retry() -> None:
    limiter = RateLimiter(rate_per_s=1.0, burst=2)
    a = KeyInfo(1, "a", "product", "shop", "fwp_a")
    b = KeyInfo(2, "b", "product", "shop", "fwp_b")
    limiter.admit(a, 0.0)
    limiter.admit(a, 0.0)
    with pytest.raises(AccessDenied) as caught:
        limiter.admit(a, 0.0)
    err = caught.value
    assert err.status == 429 and err.retry_after_s == pytest.approx(1.0) and "1 requests/s, burst 2" in err.reason
    assert retry_after_header(err.retry_after_s) == b"1" and retry_after_header(0.01) == b"1"
    assert retry_after_header(2.2) == b"3"
    limiter.admit(b, 0.0)  # another key has its own bucket
    limiter.admit(a, 1.0)


def test_a_keys_own_limits_override_the_defaults() -> None:
    limiter = RateLimiter(rate_per_s=1.0, burst=1)
    fast = KeyInfo(1, "fast", "product", "shop", "fwp_f", rate_per_s=100.0, burst=50)
    for _ in range(50):
        limiter.admit(fast, 0.0)
    with pytest.raises(AccessDenied) as caught:
        limiter.admit(fast, 0.0)
    assert caught.value.retry_after_s == pytest.approx(0.01)
    slowed = KeyInfo(1, "fast", "product", "shop", "fwp_f", rate_per_s=0.5, burst=1)  # changed in the database
    limiter.admit(slowed, 10.0)
    with pytest.raises(AccessDenied) as caught:
        limiter.admit(slowed, 10.0)
    assert caught.value.retry_after_s == pytest.approx(2.0)
    limiter.forget(keep={2})
    assert limiter.buckets == {}


def test_create_key_refuses_a_product_key_without_a_project_or_with_a_bad_limit() -> None:
    # These checks come before any database write, so no session is needed.
    for kwargs, field in [
        ({"role": "product"}, "project"),
        ({"role": "product", "project": "p", "rate_per_s": 0.0}, "rate_per_s"),
        ({"role": "product", "project": "p", "burst": 0}, "burst"),
        ({"role": "writer", "project": "p", "rate_per_s": 5.0}, "rate_per_s"),
    ]:
        with pytest.raises(ValueError, match=field):
            create_key(None, name="k", **kwargs)  # type: ignore[arg-type]
