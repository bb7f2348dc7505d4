"""The engine's prompt ids straight from JSON into numpy (gateway.engine_ids) equal the list path
(decode the JSON, convert the list) for any input, and the response around them is untouched."""

from __future__ import annotations

import json

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway import engine_ids
from gateway.capture import Capture

ids = st.lists(st.integers(0, 2**31 - 1) | st.sampled_from([0, 1, 9, 10, 99, 100]), max_size=60)
whitespace = st.sampled_from(["", " ", "\n", "\t", "\r\n  "])


def list_path(span: bytes):
    """What the capture did before: decode into a list, then convert."""
    return np.asarray(msgspec.json.decode(span), dtype=np.int32)


def same_as_list_path(span: bytes) -> None:
    try:
        expected = list_path(span)
    except (msgspec.DecodeError, ValueError, OverflowError, TypeError) as exc:
        with pytest.raises(type(exc)):
            engine_ids.parse(span)
        return
    got = engine_ids.parse(span)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, expected)


@settings(max_examples=300)
@given(ids, whitespace, whitespace)
def test_any_json_array_of_ids_parses_as_the_list_path(values, before, after) -> None:
    sep = "," + after
    span = ("[" + before + sep.join(map(str, values)) + before + "]").encode()
    same_as_list_path(span)
    same_as_list_path(msgspec.json.encode(values))
    same_as_list_path(json.dumps(values, indent=1).encode())


@settings(max_examples=300)
@given(st.text(alphabet="0123456789,-. e+\n[]", max_size=30))
def test_anything_else_parses_or_fails_as_the_list_path(text) -> None:
    same_as_list_path(("[" + text + "]").encode())


@given(st.lists(st.integers(-(2**40), 2**40) | st.floats(-1e6, 1e6), max_size=20))
def test_numbers_beyond_plain_ids_go_the_list_path(values) -> None:
    same_as_list_path(msgspec.json.encode(values))


texts = st.text(alphabet='ab"\\:[],{}prompt_token_ids', max_size=40)


@settings(max_examples=200)
@given(ids, texts, st.booleans())
def test_split_cuts_only_the_prompt_ids_and_keeps_the_rest(prompt, content, legacy) -> None:
    """Whatever the model wrote (even the key's own text), only the real array is cut, and the
    decoded rest is the response without it."""
    choice = {"index": 0, "text" if legacy else "message": content, "token_ids": [5, 6]}
    resp = {"id": content, "choices": [choice], "usage": {"prompt_tokens": len(prompt)}}
    (choice if legacy else resp)["prompt_token_ids"] = prompt
    rest, span = engine_ids.split(msgspec.json.encode(resp))
    assert span == msgspec.json.encode(prompt)
    payload = msgspec.json.decode(rest)
    holder = engine_ids.holder(payload)
    assert holder is (payload["choices"][0] if legacy else payload)
    holder[engine_ids.KEY] = prompt
    assert payload == resp


def test_an_array_nested_elsewhere_has_no_holder() -> None:
    raw = msgspec.json.encode({"kv_transfer_params": {"prompt_token_ids": [1, 2]}, "choices": []})
    rest, span = engine_ids.split(raw)
    assert span == b"[1,2]"
    assert engine_ids.holder(msgspec.json.decode(rest)) is None


def test_the_capture_keeps_the_ids_it_was_handed_first() -> None:
    cap = Capture()
    cap.set_prompt(np.array([3, 4], dtype=np.int32))
    cap.add_chunk({"prompt_token_ids": msgspec.Raw(b"[3,4]"), "choices": []}, 0)
    cap.add_chunk({"prompt_token_ids": [9], "choices": []}, 0)
    np.testing.assert_array_equal(cap.prompt_ids, [3, 4])
    fresh = Capture()
    fresh.add_chunk({"prompt_token_ids": [7, 8], "choices": []}, 0)
    assert fresh.prompt_ids.dtype == np.int32
    np.testing.assert_array_equal(fresh.prompt_ids, [7, 8])


@pytest.mark.parametrize(
    "span",
    [b"[01]", b"[1,01]", b"[0,0]", b"[10,0]", b"[0]", b"[00]", b"[1,00,2]", b"[0,10,100,0]",
     b"[1,]", b"[,1]", b"[1,,2]", b"[99999999999999999999]", b"[2147483648]", b"[]", b"[ ]"],
)  # fmt: skip
def test_edge_cases_parse_or_fail_as_the_list_path(span) -> None:
    same_as_list_path(span)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(ids, whitespace, st.booleans()), min_size=1, max_size=80))
def test_pieces_are_the_array_of_all_of_them(arrays):
    def dump(x, ws, spaced):
        text = json.dumps(x, separators=None if spaced else (",", ":"))
        return (text if x else f"[{ws}]").encode()

    pieces: engine_ids.Pieces = ()
    for values, ws, spaced in arrays:
        pieces = engine_ids.extend(pieces, dump(values, ws, spaced))
    assert len(pieces) <= 64
    expected = [v for values, _, _ in arrays for v in values]
    assert msgspec.json.decode(engine_ids.concat(pieces)) == expected
    assert msgspec.json.decode(msgspec.json.encode(engine_ids.items(pieces))) == expected


def _chunk(tokens: list, logprobs: list[float]) -> dict:
    content = [{"token": t, "logprob": lp} for t, lp in zip(tokens, logprobs, strict=True)]
    return {"choices": [{"index": 0, "delta": {"content": "x"}, "logprobs": {"content": content}}]}


@given(st.lists(st.integers(0, 2**31 - 1), max_size=40))
def test_sampled_ids_not_echoed_are_read_from_the_logprob_tokens(values) -> None:
    cap = Capture()
    cap.ids_in_logprobs = True
    cap.add_chunk(_chunk([f"token_id:{v}" for v in values], [-0.5] * len(values)), version=3)
    assert list(cap.completion_ids) == values
    assert len(cap.logprobs) == len(values)
    assert cap.versions().tolist() == [3] * len(values)


@pytest.mark.parametrize(
    "token",
    ["12", "token_id:", "token_id:-1", "token_id: 7", "token_id:1_0", "token_id:٣", 5]
    + ["token_id:2147483648"],
)
def test_a_logprob_token_that_is_not_an_id_takes_no_ids(token) -> None:
    """One token not written `token_id:N` (text, a sign, a space, another script's digit): no
    ids are taken from the chunk, so the engine's count check fails instead of a wrong id."""
    cap = Capture()
    cap.ids_in_logprobs = True
    cap.add_chunk(_chunk(["token_id:4", token], [-1.0, -1.0]), version=0)
    assert list(cap.completion_ids) == [] and list(cap.logprobs) == []
    cap.set_prompt(np.arange(3, dtype=np.int32))
    cap.usage = {"prompt_tokens": 3, "completion_tokens": 2}
    assert cap.check() == "engine counted 2 completion tokens but returned 0 ids"


def test_ids_are_not_read_from_logprob_tokens_unless_asked() -> None:
    cap = Capture()
    cap.add_chunk(_chunk(["token_id:4"], [-1.0]), version=0)
    assert list(cap.completion_ids) == []
