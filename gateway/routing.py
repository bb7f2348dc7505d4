"""Where a rollout's calls go: rendezvous hashing onto healthy replicas, and replica health.

Rendezvous (highest-random-weight) hashing scores every replica for a rollout and takes the
best eligible one. Adding a replica takes over only the rollouts it now outscores (about 1/N);
removing one moves only the rollouts it held. Every gateway computes the same placement from the
same replica list, so gateways behind a load balancer agree without talking to each other.

Health is a small state machine per replica fed by active probes and by the calls themselves:
after `eject_after` consecutive failures a replica is ejected (no calls) until a probe passes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np

_MASK = (1 << 64) - 1
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB


def replica_seed(url: str) -> int:
    """A replica's 64-bit identity in the hash: from its URL only, so all gateways agree."""
    return int.from_bytes(hashlib.blake2b(url.encode(), digest_size=8).digest(), "little")


def _mix(x: int) -> int:
    # splitmix64's finaliser: every input bit reaches every output bit.
    x = ((x ^ (x >> 30)) * _M1) & _MASK
    x = ((x ^ (x >> 27)) * _M2) & _MASK
    return x ^ (x >> 31)


def scores(key: int, seeds: np.ndarray) -> np.ndarray:
    """Each replica's weight for `key` (a rollout id's 128-bit integer). One vectorised
    multiply-xorshift round over `seeds` (uint64) keeps a 64-replica decision to a few µs."""
    k = np.uint64(_mix((key ^ (key >> 64)) & _MASK))
    with np.errstate(over="ignore"):
        x = seeds ^ k
        x *= np.uint64(_M1)
        x ^= x >> np.uint64(29)
        x *= np.uint64(_M2)
    return x


def place(key: int, seeds: np.ndarray, eligible: np.ndarray | None = None) -> int:
    """Index of the replica `key` goes to: the highest score among `eligible` (a bool mask,
    all if None); -1 when none is eligible."""
    s = scores(key, seeds)
    if eligible is None:
        return int(s.argmax()) if len(s) else -1
    if not eligible.any():
        return -1
    return int(np.where(eligible, s, 0).argmax())


@dataclass
class Health:
    """One replica's health, fed by probes and calls. Pure: the caller passes the time.

    A failed call counts once per rollout in a run of failures, a failed probe every time: one
    rollout's calls alone (whatever it sends) never eject a replica that other rollouts and the
    prober find working, while a dead replica fails its probes and goes."""

    eject_after: int = 3
    failures: int = 0  # consecutive, as counted
    ejected: bool = False
    reason: str | None = None  # the last failure
    since: float = 0.0  # when `ejected` last changed (monotonic seconds)
    sources: set[Hashable] = field(default_factory=set)  # rollouts counted in this run

    def failure(self, now: float, reason: str, source: Hashable | None = None) -> bool:
        """Counts a failure of a call of rollout `source` (None: a probe); True if it ejects
        the replica just now."""
        self.reason = reason
        if source is not None:
            if source in self.sources:
                return False
            self.sources.add(source)
        self.failures += 1
        if not self.ejected and self.failures >= self.eject_after:
            self.ejected, self.since = True, now
            return True
        return False

    def success(self, now: float) -> bool:
        """A passed probe or a good call; True if it takes an ejected replica back."""
        self.failures = 0
        self.sources.clear()
        if self.ejected:
            self.ejected, self.since = False, now
            return True
        return False
