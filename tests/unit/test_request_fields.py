"""The allow-list of request fields (hypothesis): whatever a harness sends, only neutral,
constraining or caller-handled fields stay, and none of those is ever removed."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gateway.constraints import CONSTRAINING, NEUTRAL, strip_unknown

known = sorted(NEUTRAL | CONSTRAINING | {"temperature"})
names = st.one_of(st.sampled_from(known), st.text(max_size=12))


@given(st.dictionaries(names, st.integers(), max_size=30))
def test_only_known_fields_stay_and_none_of_them_goes(body):
    before = dict(body)
    stripped = strip_unknown(body, frozenset({"temperature"}))
    assert set(body) <= set(known)
    assert {k: before[k] for k in before if k in set(known)} == body
    assert stripped == sorted(set(before) - set(body))


def test_fields_that_change_sampling_are_not_on_the_list():
    for field in ("use_beam_search", "length_penalty", "vllm_xargs", "kv_transfer_params",
                  "watermarking", "logit_bias", "seed", "prompt_logprobs"):
        assert field not in NEUTRAL | CONSTRAINING
