"""The benchmarks' stand-in engine: synthetic replies of the asked length, the same for every
call, or (`vary`) starting at a random token of the recorded reply so that the replies a group
gets differ, with ids, logprobs and text that still agree with each other."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.standin import Synthetic, _Flags

BODY = b'{"messages": [{"role": "user", "content": "hi"}]}'


def _choice(replies: Synthetic) -> dict:
    frames = replies.answer(_Flags(return_token_ids=True), BODY)
    body = frames[0].split(b"\r\n\r\n", 1)[1]
    return msgspec.json.decode(body)["choices"][0]


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 300))
def test_varied_replies_are_the_asked_length_and_agree_with_themselves(n):
    replies = Synthetic(256, n, template=False, vary=True)
    for _ in range(5):
        choice = _choice(replies)
        content = choice["logprobs"]["content"]
        assert len(choice["token_ids"]) == len(content) == n
        assert choice["message"]["content"] == "".join(e["token"] for e in content)


def test_varied_replies_differ_and_fixed_ones_do_not():
    fixed = Synthetic(256, 128)
    assert len({tuple(_choice(fixed)["token_ids"]) for _ in range(8)}) == 1
    varied = Synthetic(256, 128, vary=True)
    assert len({tuple(_choice(varied)["token_ids"]) for _ in range(8)}) >= 6
