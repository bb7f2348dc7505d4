"""Token buckets by key: at most `burst` events at once, refilled at `rate` a second.

Pure: the caller passes the time. Bounded: the least recently used keys are forgotten beyond
`max_keys`, which can only give a forgotten key a full bucket again, never take one away.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable


class TokenBuckets:
    def __init__(self, rate: float, burst: float, max_keys: int = 10_000) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("a bucket needs rate > 0 and burst >= 1")
        self.rate = rate
        self.burst = burst
        self._max_keys = max_keys
        self._buckets: OrderedDict[Hashable, tuple[float, float]] = OrderedDict()  # tokens, at

    def _level(self, key: Hashable, now: float) -> float:
        tokens, at = self._buckets.get(key, (self.burst, now))
        return min(self.burst, tokens + max(now - at, 0.0) * self.rate)

    def wait(self, key: Hashable, now: float) -> float:
        """Seconds until `key` may spend a token (0.0: now). Spends nothing."""
        level = self._level(key, now)
        return 0.0 if level >= 1.0 else (1.0 - level) / self.rate

    def spend(self, key: Hashable, now: float) -> None:
        """Takes one token from `key`'s bucket (it may go below zero: a debt repaid by waiting)."""
        self._buckets[key] = (self._level(key, now) - 1.0, now)
        self._buckets.move_to_end(key)
        if len(self._buckets) > self._max_keys:
            self._buckets.popitem(last=False)
