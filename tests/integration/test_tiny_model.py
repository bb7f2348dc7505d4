"""The tiny model: a deterministic offline build, a prefix-preserving ChatML/Hermes template, a
lossless tokenizer, and real vLLM serving it with the local rendering as its prompt and real,
schema-valid tool calls."""

from __future__ import annotations

import json
import re
import unicodedata

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from stack import tiny_model

# The fixtures (tiny_model_dir, tiny_tokenizer, vllm_server) come in through tests/conftest.py.
from tests.support.vllm import PICK_COLOR_TOOL, tool_call_request

MODEL_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
}


def read_all(directory) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir()}


def render(tokenizer, messages, tools=None, generation_prompt=False) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt
    )


def render_ids(tokenizer, messages, tools=None, generation_prompt=False) -> list[int]:
    return tokenizer(
        render(tokenizer, messages, tools, generation_prompt), add_special_tokens=False
    )["input_ids"]


# --- the build -----------------------------------------------------------------------------


def test_same_seed_gives_byte_identical_files(tmp_path):
    first = read_all(tiny_model.write_tiny_model(tmp_path / "a", seed=3))
    second = read_all(tiny_model.write_tiny_model(tmp_path / "b", seed=3))
    assert set(first) == MODEL_FILES
    assert first == second


def test_another_seed_changes_the_weights_and_nothing_else(tmp_path):
    a = tiny_model.write_tiny_model(tmp_path / "a", seed=0)
    b = tiny_model.write_tiny_model(tmp_path / "b", seed=1)
    files_a, files_b = read_all(a), read_all(b)
    assert {n for n in MODEL_FILES if files_a[n] != files_b[n]} == {"model.safetensors"}
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys()
    assert not np.allclose(wa["model.embed_tokens.weight"], wb["model.embed_tokens.weight"])


def test_a_deeper_model_has_its_layers_and_the_same_first_ones(tmp_path):
    """`layers` (the throughput benchmark's trainer size) adds layers and changes nothing of
    what comes before them."""
    base = tiny_model.write_tiny_model(tmp_path / "base", seed=0)
    deep = tiny_model.write_tiny_model(tmp_path / "deep", seed=0, layers=5)
    config = json.loads((deep / "config.json").read_text())
    assert config["num_hidden_layers"] == config["max_window_layers"] == 5
    wb, wd = load_file(str(base / "model.safetensors")), load_file(str(deep / "model.safetensors"))
    assert {k.split(".")[2] for k in wd if k.startswith("model.layers.")} == set("01234")
    assert np.array_equal(wb["model.embed_tokens.weight"], wd["model.embed_tokens.weight"])
    assert np.array_equal(wb["model.layers.0.mlp.up_proj.weight"],
                          wd["model.layers.0.mlp.up_proj.weight"])


def test_model_matches_its_spec_and_does_not_stop_at_once(tiny_model_dir, tiny_tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    config = model.config
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (128, 2, 2048)
    assert (config.num_attention_heads, config.num_key_value_heads) == (2, 1)
    assert config.tie_word_embeddings and config.max_position_embeddings >= 4096
    assert len(tiny_tokenizer) == config.vocab_size
    assert tiny_tokenizer.eos_token == "<|im_end|>"
    for text, _ in tiny_model.ADDED_TOKENS:
        assert tiny_tokenizer.convert_tokens_to_ids(text) is not None
    prompt = render_ids(tiny_tokenizer, [{"role": "user", "content": "Hi"}], None, True)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, -1]
    probs = logits.softmax(-1)
    # Near-uniform: no token, the end of turn included, is anywhere near certain.
    assert probs.max().item() < 20 / config.vocab_size
    assert probs[tiny_tokenizer.eos_token_id].item() < 20 / config.vocab_size


# --- the chat template ---------------------------------------------------------------------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "Weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}

EXPECTED_RENDERING = (
    "<|im_start|>system\nBe brief.\n\n# Tools\n\n"
    "These functions are available, one JSON signature per line:\n<tools>\n"
    '{"name": "weather", "description": "Weather in a city.", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}\n'
    "</tools>\n\nTo call a function, answer with its name and a JSON object of arguments "
    "between tool-call tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <arguments-object>}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\nWeather in Oslo and Lima?<|im_end|>\n"
    "<|im_start|>assistant\n<think>\nTwo cities.\n</think>\n\nChecking.\n"
    '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "weather", "arguments": {"city": "Lima"}}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n<tool_response>\nrain\n</tool_response>\n"
    "<tool_response>\nsun\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\nRain in Oslo, sun in Lima.<|im_end|>\n"
    "<|im_start|>user\nThanks<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def weather_conversation(arguments_as_text: bool) -> list[dict]:
    def call(i: int, city: str) -> dict:
        args = {"city": city}
        return {
            "id": f"call_{i}",
            "type": "function",
            "function": {"name": "weather", "arguments": json.dumps(args) if arguments_as_text
                         else args},
        }

    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo and Lima?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Two cities.",
         "tool_calls": [call(1, "Oslo"), call(2, "Lima")]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "sun"}]},
        {"role": "assistant", "content": "Rain in Oslo, sun in Lima."},
        {"role": "user", "content": "Thanks"},
    ]


@pytest.mark.parametrize("arguments_as_text", [False, True])
def test_template_renders_every_message_kind(tiny_tokenizer, arguments_as_text):
    messages = weather_conversation(arguments_as_text)
    assert render(tiny_tokenizer, messages, [WEATHER_TOOL], True) == EXPECTED_RENDERING


def test_template_without_tools_or_system(tiny_tokenizer):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert render(tiny_tokenizer, messages) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"
    )
    tools_only = render(tiny_tokenizer, messages[:1], [WEATHER_TOOL])
    assert tools_only.startswith("<|im_start|>system\n# Tools\n")
    assert tools_only.endswith("</tool_call><|im_end|>\n<|im_start|>user\nHi<|im_end|>\n")


texts = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=24)
tool_calls = st.lists(
    st.builds(
        lambda name, args, as_text: {
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(args) if as_text else args},
        },
        st.sampled_from(["weather", "run"]),
        st.dictionaries(st.sampled_from(["city", "cmd"]), texts, max_size=2),
        st.booleans(),
    ),
    min_size=1,
    max_size=3,
)
turns = st.one_of(
    st.builds(lambda c: {"role": "user", "content": c}, texts),
    st.builds(lambda c: {"role": "assistant", "content": c}, texts),
    st.builds(lambda c, r: {"role": "assistant", "content": c, "reasoning_content": r},
              texts, texts.filter(bool)),
    st.builds(lambda c, calls: {"role": "assistant", "content": c, "tool_calls": calls},
              st.one_of(st.none(), texts), tool_calls),
    st.builds(lambda c: {"role": "tool", "tool_call_id": "x", "content": c}, texts),
)
conversations = st.tuples(
    st.lists(st.builds(lambda c: {"role": "system", "content": c}, texts), max_size=1),
    st.lists(turns, min_size=1, max_size=8),
).map(lambda parts: parts[0] + parts[1])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages=conversations, with_tools=st.booleans())
def test_template_is_prefix_preserving(tiny_tokenizer, messages, with_tools):
    tools = [WEATHER_TOOL] if with_tools else None
    previous_text = render(tiny_tokenizer, messages[:1], tools)
    previous_ids = render_ids(tiny_tokenizer, messages[:1], tools)
    for k in range(2, len(messages) + 1):
        text, ids = render(tiny_tokenizer, messages[:k], tools), render_ids(
            tiny_tokenizer, messages[:k], tools)
        assert text.startswith(previous_text)
        # Token-level too: every rendering ends at a turn or tool-response boundary.
        assert ids[: len(previous_ids)] == previous_ids
        if messages[k - 1]["role"] == "assistant":
            # The prompt a reply was sampled from is a prefix of the conversation that quotes it.
            assert text.startswith(render(tiny_tokenizer, messages[: k - 1], tools, True))
        previous_text, previous_ids = text, ids


# --- the tokenizer -------------------------------------------------------------------------

added_texts = st.sampled_from([text for text, _ in tiny_model.ADDED_TOKENS])
mixed_texts = st.lists(st.one_of(texts, added_texts), max_size=6).map("".join)


@settings(max_examples=200, deadline=None)
@given(text=mixed_texts)
def test_tokenizer_round_trips_text(tiny_tokenizer, tiny_model_dir, text):
    # The tokenizer NFC-normalises (as Qwen's does), so only NFC text can round-trip exactly.
    text = unicodedata.normalize("NFC", text)
    ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tiny_tokenizer.decode(ids, skip_special_tokens=False) == text
    # tokenizer.json alone (what a process without transformers loads) gives the same ids.
    raw = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    assert raw.encode(text, add_special_tokens=False).ids == ids


def test_tool_tags_survive_skip_special_tokens(tiny_tokenizer):
    # vLLM's hermes parser reads the decoded text: the tags must not be stripped as special.
    text = '<tool_call>\n{"name": "x", "arguments": {}}\n</tool_call><|im_end|>'
    ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tiny_tokenizer.decode(ids, skip_special_tokens=True) == text.removesuffix("<|im_end|>")


# --- served by vLLM ------------------------------------------------------------------------


def chat(server, body: dict) -> dict:
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def stream_chat(server, body: dict) -> dict:
    """Collect a streamed completion into prompt ids, sampled ids, logprobs and tool calls."""
    out = {"prompt_token_ids": None, "token_ids": [], "logprobs": [], "calls": {}, "finish": None}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if chunk.get("prompt_token_ids") is not None:
                assert out["prompt_token_ids"] is None, "prompt ids come once"
                out["prompt_token_ids"] = chunk["prompt_token_ids"]
            for choice in chunk["choices"]:
                out["token_ids"] += choice.get("token_ids") or []
                if choice.get("logprobs"):
                    out["logprobs"] += choice["logprobs"]["content"]
                for tc in (choice.get("delta") or {}).get("tool_calls") or []:
                    slot = out["calls"].setdefault(tc["index"], {"name": "", "arguments": ""})
                    slot["name"] += (tc.get("function") or {}).get("name") or ""
                    slot["arguments"] += (tc.get("function") or {}).get("arguments") or ""
                out["finish"] = choice.get("finish_reason") or out["finish"]
    return out


def assert_tokens_match(tokenizer, token_ids: list[int], logprobs: list[dict]) -> None:
    """Each logprob entry names its own sampled token (for output that is plain ASCII text)."""
    assert len(token_ids) == len(logprobs) > 0
    assert [e["token"] for e in logprobs] == [tokenizer.decode([t]) for t in token_ids]
    assert all(e["logprob"] <= 0 for e in logprobs)


def local_logprobs(model_dir, prompt_ids: list[int], token_ids: list[int]) -> np.ndarray:
    """log p(token_ids[i] | prompt, token_ids[:i]) from transformers, for comparison with vLLM."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt_ids + token_ids])).logits[0]
    steps = logits[len(prompt_ids) - 1 : -1].log_softmax(-1)
    return steps[torch.arange(len(token_ids)), torch.tensor(token_ids)].numpy()


CAPTURE = {"return_token_ids": True, "logprobs": True, "top_logprobs": 0}


def test_vllm_prompt_ids_equal_the_local_rendering(vllm_server, tiny_tokenizer):
    messages = weather_conversation(arguments_as_text=True)
    body = {"model": vllm_server.model, "messages": messages, "tools": [WEATHER_TOOL],
            "max_tokens": 12, **CAPTURE}
    response = chat(vllm_server, body)
    # vLLM parses string arguments and the template re-serialises them, so the local rendering
    # of the parsed form is the engine's prompt.
    local = render_ids(tiny_tokenizer, weather_conversation(False), [WEATHER_TOOL], True)
    assert response["prompt_token_ids"] == local
    choice = response["choices"][0]
    token_ids, logprobs = choice["token_ids"], choice["logprobs"]["content"]
    assert len(token_ids) == len(logprobs) == response["usage"]["completion_tokens"] > 0
    # Aligned 1:1: the model itself gives each sampled id the logprob vLLM reported for it.
    expected = local_logprobs(vllm_server.model_dir, local, token_ids)
    np.testing.assert_allclose([e["logprob"] for e in logprobs], expected, atol=1e-3)
    rendered = httpx.post(vllm_server.url + "/v1/chat/completions/render", timeout=60,
                          json={"model": vllm_server.model, "messages": messages,
                                "tools": [WEATHER_TOOL]})
    assert rendered.status_code == 200, rendered.text
    assert rendered.json()["token_ids"] == local


def test_vllm_serves_the_rl_endpoints(vllm_server):
    paused = httpx.get(vllm_server.url + "/is_paused", timeout=30)
    assert paused.status_code == 200, paused.text
    assert paused.json() == {"is_paused": False}


SAMPLED_CALL = re.compile(r"^<tool_call>\s*(\{.*\})\s*</tool_call>$", re.DOTALL)


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_call_is_real_and_token_faithful(vllm_server, tiny_tokenizer, stream):
    messages = [{"role": "user", "content": "Pick a color."}]
    body = tool_call_request(messages, stream=stream, **CAPTURE)
    if stream:
        out = stream_chat(vllm_server, body)
        prompt_ids, token_ids, logprobs = out["prompt_token_ids"], out["token_ids"], out["logprobs"]
        [call] = out["calls"].values()
    else:
        response = chat(vllm_server, body)
        choice = response["choices"][0]
        prompt_ids, token_ids = response["prompt_token_ids"], choice["token_ids"]
        logprobs = choice["logprobs"]["content"]
        [tool_call] = choice["message"]["tool_calls"]
        call = tool_call["function"]
    assert prompt_ids == render_ids(tiny_tokenizer, messages, [PICK_COLOR_TOOL], True)
    assert call["name"] == "pick_color"
    arguments = json.loads(call["arguments"])
    assert arguments in ({"color": "red"}, {"color": "blue"})
    assert_tokens_match(tiny_tokenizer, token_ids, logprobs)
    # The call is what the engine sampled, not something the server made up around it.
    sampled = SAMPLED_CALL.match(tiny_tokenizer.decode(token_ids, skip_special_tokens=True))
    assert sampled, tiny_tokenizer.decode(token_ids)
    assert json.loads(sampled.group(1)) == {"name": "pick_color", "arguments": arguments}


def test_cli_writes_an_untied_model_by_default(tmp_path):
    from core.cli import main

    assert main(["tiny-model", str(tmp_path / "untied"), "--seed", "2"]) == 0
    assert main(["tiny-model", str(tmp_path / "tied"), "--seed", "2", "--tied"]) == 0
    untied = load_file(str(tmp_path / "untied" / "model.safetensors"))
    tied = load_file(str(tmp_path / "tied" / "model.safetensors"))
    assert json.loads((tmp_path / "untied" / "config.json").read_text())[
        "tie_word_embeddings"] is False
    assert json.loads((tmp_path / "tied" / "config.json").read_text())["tie_word_embeddings"]
    # Same function: the untied head starts as a copy of the embeddings.
    np.testing.assert_array_equal(untied["lm_head.weight"], untied["model.embed_tokens.weight"])
    assert "lm_head.weight" not in tied
    assert {k: v.tobytes() for k, v in tied.items()} == {
        k: v.tobytes() for k, v in untied.items() if k != "lm_head.weight"}
