"""The body a replica is sent (hypothesis): the harness's passed fields as they came, the
policy's sampling always, the capture's switches, and an exact continuation's ids as spliced."""

from __future__ import annotations

import msgspec
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from gateway.call_request import SAMPLING_KEYS, sampling_policy
from gateway.constraints import CONSTRAINING, NEUTRAL
from gateway.continuation.keys import RequestKeys
from gateway.continuation.planner import Turn
from gateway.continuation.splice import ContinuationRecord
from gateway.engine_body import EngineBody, build
from gateway.protocols.adapter import CHAT_PATH

# What the gateway itself sets, beside the harness's passed fields.
GATEWAY = {*sampling_policy(1.0), "logprobs", "top_logprobs", "return_tokens_as_token_ids",
           "kv_transfer_params"}  # fmt: skip
# The harness's: passed as they came (return_token_ids and stream_options the gateway sets).
PASSED = sorted((NEUTRAL | CONSTRAINING) - {"return_token_ids", "stream_options", "messages"})

json_values = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.text(max_size=4))
harness_fields = st.dictionaries(st.sampled_from(PASSED), json_values, max_size=12)
messages = st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": st.text()}),
                    min_size=1, max_size=3)  # fmt: skip


def test_the_body_has_a_field_for_each_allowed_one_and_for_what_the_gateway_sets():
    fields = set(EngineBody.__struct_fields__)
    assert NEUTRAL | CONSTRAINING <= fields
    assert fields - (NEUTRAL | CONSTRAINING) == GATEWAY
    assert not fields & (set(SAMPLING_KEYS) - GATEWAY)  # the harness's sampling never goes


@given(harness_fields, messages, st.sampled_from([CHAT_PATH, "/v1/completions"]))
def test_the_harness_fields_go_as_they_came_under_the_policys_sampling(fields, msgs, path):
    fields = {**fields, "model": "m", "messages": msgs}
    before = msgspec.json.encode(fields)
    sampling = sampling_policy(0.7)
    sent = build(fields, sampling, path, False, None, False)
    assert msgspec.json.encode(fields) == before  # read, not changed
    body = msgspec.json.decode(sent.encoded)
    gateway = {**sampling, "return_token_ids": True}
    if path == CHAT_PATH:
        gateway |= {"logprobs": True, "top_logprobs": 0}
    else:
        gateway |= {"logprobs": 0}
    if fields.get("stream"):
        gateway["stream_options"] = {"include_usage": True}
    assert body == {**fields, **gateway}
    assert sent.streamed == bool(fields.get("stream")) and sent.prompt_json is None


@given(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=20), st.booleans(), messages)
def test_an_exact_continuation_sends_its_ids_and_asks_no_echo_unless_wanted(ids, wants, msgs):
    prompt = np.asarray(ids, dtype=np.int32)
    keys = RequestKeys({"messages": msgs})
    plan = Turn(keys, ContinuationRecord(path="exact", messages=1), prompt_ids=prompt)
    sent = build({"model": "m", "messages": msgs}, sampling_policy(1.0), CHAT_PATH, False, plan,
                 wants)  # fmt: skip
    body = msgspec.json.decode(sent.encoded)
    assert body["kv_transfer_params"] == {"prompt_token_ids": ids}
    assert sent.prompt_ids is prompt and sent.ids_in_logprobs == (not wants)
    if wants:  # the engine echoes the ids; the echo is known by them
        assert body["return_token_ids"] is True and "return_tokens_as_token_ids" not in body
        assert sent.echo_expected == msgspec.json.encode(ids)
    else:
        assert "return_token_ids" not in body and body["return_tokens_as_token_ids"] is True
        assert sent.echo_expected is None
    assert body["messages"] == msgs  # the continued reply and what follows it: all of them here
