"""The sampling policy check (trainer_bridge/policy.py, pure): the trainer's sampling against the
one a gateway publishes, every differing knob named."""

from __future__ import annotations

import pytest

from trainer_bridge.policy import SamplingMismatch, check_sampling, mismatches, trainer_sampling

TRL_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": None,
                "repetition_penalty": 1.0}
PINNED = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "presence_penalty": 0.0,
          "frequency_penalty": 0.0, "repetition_penalty": 1.0}


def test_equal_policies_pass_and_off_means_off():
    assert mismatches(PINNED, trainer_sampling(TRL_DEFAULTS)) == []
    assert mismatches({**PINNED, "top_k": -1}, trainer_sampling(TRL_DEFAULTS)) == []


def test_every_differing_knob_is_named_with_both_values():
    trainer = trainer_sampling({**TRL_DEFAULTS, "temperature": 0.7})
    problems = mismatches({**PINNED, "presence_penalty": 0.5}, trainer)
    assert problems == ["temperature is 1 at the gateway but 0.7 in the trainer",
                        "presence_penalty is 0.5 at the gateway but 0 in the trainer"]
    with pytest.raises(SamplingMismatch, match="does not publish"):
        check_sampling({"http://old-gateway": {"version": 3}}, trainer)
