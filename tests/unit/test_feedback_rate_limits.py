"""The gateway's feedback limits: a bucket per feedback token and one per signing write key (pure logic)."""

from __future__ import annotations

import pytest

from flywheel.core.ratelimit import KeyedBuckets
from flywheel.core.settings import IngestSettings
from ingest.feedback import FeedbackError, FeedbackLimits


def test_keyed_buckets_refill_per_key_and_forget_the_least_recently_used() -> None:
    buckets = KeyedBuckets(rate_per_s=2.0, burst=2, max_keys=2)
    assert [buckets.take("a", 0.0) for _ in range(3)] == [0.0, 0.0, 0.5]
    assert buckets.take("a", 0.5) == 0.0  # one token back after 0.5 s at 2/s
    assert buckets.take("b", 0.5) == 0.0
    assert buckets.take("c", 0.5) == 0.0  # "a" is forgotten: at most two keys
    assert len(buckets) == 2
    assert buckets.take("a", 0.5) == 0.0  # back, with a full bucket
    with pytest.raises(ValueError, match="rate_per_s > 0"):
        KeyedBuckets(0.0, 1, 1)


def test_a_token_and_a_signing_key_each_have_their_own_limit() -> None:
    cfg = IngestSettings(
        feedback_token_rate_per_s=1.0, feedback_token_burst=2, feedback_key_rate_per_s=1.0, feedback_key_burst=3
    )
    limits = FeedbackLimits(cfg)
    limits.admit("token-1", "key-a", 0.0)
    limits.admit("token-1", "key-a", 0.0)
    with pytest.raises(FeedbackError) as refused:
        limits.admit("token-1", "key-a", 0.0)
    assert refused.value.status_code == 429 and refused.value.headers == {"Retry-After": "1"}
    assert "this feedback token" in refused.value.detail and "ingest.feedback_token_rate_per_s" in refused.value.detail
    limits.admit("token-2", "key-a", 0.0)  # the key's third
    with pytest.raises(FeedbackError) as refused:
        limits.admit("token-3", "key-a", 0.0)  # a fresh token, but the key's burst is spent
    assert "the write key that signed this token" in refused.value.detail
    limits.admit("token-4", "key-b", 0.0)  # another key is not held up
