"""The sampling policy check: the gateway's pinned sampling must be the distribution the trainer
computes its log-probabilities under, or every importance ratio is biased.

Each gateway publishes what it pins every call to in `GET /admin/policy` (`sampling`). The
trainer's log-probabilities are a full softmax at its `temperature`; TRL's config also carries
the truncation knobs its own rollout worker would sample with (`top_p`, `top_k`, `min_p`,
`repetition_penalty`). All of them must agree, and the penalties TRL has no field for must be
off. The bridge refuses to start otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

# What "off" is for each knob; top_k 0 and -1 both mean no truncation to vLLM, min_p None is 0.
_NEUTRAL = {
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
}


class SamplingMismatch(ValueError):
    """The gateway samples from another distribution than the one the trainer trains."""


def trainer_sampling(grpo_fields: Mapping[str, object]) -> dict[str, float]:
    """The sampling the trainer assumes, from its AsyncGRPOConfig values (pure)."""
    sampling = {"temperature": grpo_fields["temperature"]}
    sampling.update((key, grpo_fields.get(key, neutral)) for key, neutral in _NEUTRAL.items())
    return {key: _normal(key, value) for key, value in sampling.items()}


def _normal(key: str, value) -> float:
    if value is None:
        return float(_NEUTRAL[key])
    if key == "top_k" and value < 0:
        return 0.0
    return float(value)


def mismatches(published: Mapping[str, object], trainer: Mapping[str, float]) -> list[str]:
    """Each knob on which a gateway's published sampling and the trainer's differ, as
    'KEY is GATEWAY at the gateway but TRAINER in the trainer' (pure)."""
    out = []
    for key, expected in trainer.items():
        got = published.get(key, _NEUTRAL.get(key))
        if got is None and key == "temperature":
            out.append(f"temperature is not published by the gateway but {expected:g} in the "
                       "trainer")
            continue
        got = _normal(key, got)
        if not math.isclose(got, expected, rel_tol=1e-6, abs_tol=1e-9):
            out.append(f"{key} is {got:g} at the gateway but {expected:g} in the trainer")
    return out


def check_sampling(policies: Mapping[str, Mapping], trainer: Mapping[str, float]) -> None:
    """Raise SamplingMismatch naming every gateway and knob that differs from the trainer."""
    problems = []
    for gateway, policy in policies.items():
        sampling = policy.get("sampling")
        if not isinstance(sampling, Mapping):
            problems.append(f"{gateway} does not publish its sampling policy in GET "
                            "/admin/policy (a gateway older than this bridge: upgrade it)")
            continue
        problems += [f"{gateway}: {m}" for m in mismatches(sampling, trainer)]
    if problems:
        raise SamplingMismatch(
            "the gateway's sampling differs from the trainer's, which would bias every "
            "importance ratio:\n  " + "\n  ".join(problems) + "\nSet the bridge's "
            "--temperature (and --set top_p=... etc.) to the gateway's values, or restart the "
            "gateway with the trainer's --temperature."
        )
