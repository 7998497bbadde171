"""Token buckets: the router's per-key limits and the gateway's feedback limits (pure logic).

:class:`TokenBucket` admits ``burst`` requests at once and ``rate_per_s`` after that.
:class:`KeyedBuckets` holds one bucket per key in a bounded map (least recently used dropped
first, so a flood of distinct keys cannot grow it without bound; a dropped key starts full again).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass


@dataclass
class TokenBucket:
    """``burst`` tokens at most, refilled at ``rate_per_s``; a request takes one."""

    rate_per_s: float
    burst: int
    tokens: float
    updated: float
    """Monotonic time of the last refill."""

    @classmethod
    def full(cls, rate_per_s: float, burst: int, now: float) -> TokenBucket:
        """A bucket with all its tokens."""
        return cls(rate_per_s, burst, float(burst), now)

    def take(self, now: float) -> float:
        """Take a token: 0.0 when granted, else the seconds until one is there (nothing taken)."""
        self.tokens = min(float(self.burst), self.tokens + max(0.0, now - self.updated) * self.rate_per_s)
        self.updated = max(self.updated, now)
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate_per_s


class KeyedBuckets:
    """A :class:`TokenBucket` per key, ``max_keys`` at most (least recently used forgotten first)."""

    def __init__(self, rate_per_s: float, burst: int, max_keys: int):
        if rate_per_s <= 0 or burst < 1 or max_keys < 1:
            raise ValueError(f"need rate_per_s > 0, burst >= 1, max_keys >= 1; got {rate_per_s}, {burst}, {max_keys}")
        self.rate_per_s, self.burst, self.max_keys = rate_per_s, burst, max_keys
        self._buckets: OrderedDict[Hashable, TokenBucket] = OrderedDict()

    def __len__(self) -> int:
        return len(self._buckets)

    def take(self, key: Hashable, now: float) -> float:
        """Take a token from ``key``'s bucket: 0.0 when granted, else the seconds until one is there."""
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = TokenBucket.full(self.rate_per_s, self.burst, now)
            if len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(key)
        return bucket.take(now)
