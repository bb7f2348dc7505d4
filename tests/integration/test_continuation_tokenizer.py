"""The local template's tokenizer encodes exactly as the model's own (the tiny model, built by
the session fixture tiny_model_dir)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.continuation.local_template import LocalTemplate


@pytest.fixture(scope="module")
def local_and_hf(tiny_model_dir):
    from tokenizers import Tokenizer

    return LocalTemplate.from_model_dir(tiny_model_dir), Tokenizer.from_file(
        str(tiny_model_dir / "tokenizer.json")
    )


SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "</tool_call>"]


@settings(max_examples=400, deadline=None)
@given(
    st.lists(
        st.text(max_size=30)
        | st.sampled_from(SPECIALS)
        | st.text(alphabet=" \n\t\r", max_size=6)
        | st.sampled_from(["e\u0301", "\u212b", "'s", "'LL", "123 4"]),
        max_size=12,
    )
)
def test_local_tokenizer_equals_the_models(local_and_hf, pieces):
    local, hf = local_and_hf
    text = "".join(pieces)
    assert local.encode(text) == hf.encode(text, add_special_tokens=False).ids


