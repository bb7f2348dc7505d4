"""Paired statistics of two evaluations of the same prompts (pure).

The unit is the prompt: each prompt's pass rate over its samples in arm A and arm B gives a
paired difference D_i = B_i - A_i. The mean of D is the effect; its uncertainty comes from the
prompts (samples of one prompt are correlated, so resampling samples would be too narrow):
- `sign_flip_p`: the two-sided p-value of "no effect" by flipping the signs of the D_i (exact
  enumeration for a few prompts, Monte Carlo otherwise);
- `cluster_bootstrap`: a percentile interval of mean D from resampling whole prompts;
- `mde`: the smallest effect the design detects with the given power, from the spread of the
  D_i of an A/A comparison (the same model evaluated twice).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from statistics import NormalDist

import numpy as np

EXACT_UP_TO = 16  # prompts: 2**16 sign patterns are enumerated exactly


def rate(outcomes: Sequence[bool]) -> float:
    if not outcomes:
        raise ValueError("a prompt with no samples has no rate")
    return sum(outcomes) / len(outcomes)


def paired_differences(a: Mapping[str, Sequence[bool]], b: Mapping[str, Sequence[bool]]
                       ) -> dict[str, float]:
    """Per prompt present in both arms with samples in each: rate in b minus rate in a."""
    common = [k for k in a if k in b and a[k] and b[k]]
    return {k: rate(b[k]) - rate(a[k]) for k in common}


def sign_flip_p(diffs: Sequence[float], rounds: int = 20000, seed: int = 0) -> float:
    """Two-sided p-value of mean(diffs) under random sign flips of each difference."""
    d = np.asarray(diffs, dtype=float)
    if d.size == 0:
        raise ValueError("no paired differences")
    observed = abs(d.mean())
    # A tolerance: flipped means equal to the observed one up to rounding count as extreme.
    tol = 1e-12 * max(1.0, observed)
    if d.size <= EXACT_UP_TO:
        signs = np.array(list(itertools.product((1.0, -1.0), repeat=d.size)))
        means = np.abs(signs @ d) / d.size
        return float(np.mean(means >= observed - tol))
    rng = np.random.default_rng(seed)
    signs = rng.choice((1.0, -1.0), size=(rounds, d.size))
    means = np.abs(signs @ d) / d.size
    # Counting the observed pattern itself keeps a Monte Carlo p-value valid (never 0).
    return float((1 + np.sum(means >= observed - tol)) / (rounds + 1))


def cluster_bootstrap(diffs: Sequence[float], level: float = 0.95, rounds: int = 10000,
                      seed: int = 0) -> tuple[float, float]:
    """Percentile interval of mean(diffs) over resamplings of whole prompts."""
    d = np.asarray(diffs, dtype=float)
    if d.size == 0:
        raise ValueError("no paired differences")
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, d.size, (rounds, d.size))].mean(axis=1)
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def mde(aa_diffs: Sequence[float], prompts: int | None = None, alpha: float = 0.05,
        power: float = 0.8) -> float:
    """Minimum detectable effect (two-sided `alpha`, `power`) of a paired comparison over
    `prompts` prompts (default: as many as the A/A had), from the A/A differences' spread."""
    d = np.asarray(aa_diffs, dtype=float)
    if d.size < 2:
        raise ValueError("the A/A needs at least two prompts")
    n = prompts or d.size
    z = NormalDist().inv_cdf(1 - alpha / 2) + NormalDist().inv_cdf(power)
    return float(z * d.std(ddof=1) / math.sqrt(n))


def summary(a: Mapping[str, Sequence[bool]], b: Mapping[str, Sequence[bool]],
            seed: int = 0) -> dict[str, float | int]:
    """Effect, interval and p-value of b against a, in rates (0-1)."""
    diffs = list(paired_differences(a, b).values())
    lo, hi = cluster_bootstrap(diffs, seed=seed)
    return {"prompts": len(diffs), "a": float(np.mean([rate(a[k]) for k in a if a[k]])),
            "b": float(np.mean([rate(b[k]) for k in b if b[k]])),
            "effect": float(np.mean(diffs)), "ci_low": lo, "ci_high": hi,
            "p_sign_flip": sign_flip_p(diffs, seed=seed)}
