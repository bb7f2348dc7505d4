"""Real harness CLIs from npm (pinned in tests/support/harnesses.py), each run headless and offline
on one prompt against the real gateway and vLLM: every rollout gets recorded calls with the
engine's token ids over the harness's own protocol (Claude Code: Anthropic Messages; Codex:
Responses; OpenCode: chat completions), and an overlong prompt comes back in a form the harness
itself recognises as "prompt too long".

The tiny model's replies are nonsense; these tests check the protocol path, not the agent.
"""

from __future__ import annotations

import pytest

from sandbox.presets import Harness
from tests.support.detokenize import engine_text
from tests.support.harnesses import HARNESS_PACKAGES, require_harnesses, run_harness
from tests.support.vllm import TINY_MAX_MODEL_LEN

PROMPT = "Say hello."
TIMEOUT_S = 300.0
# A small output cap keeps each of Claude Code's calls short (it has no option for none).
CLAUDE_MAX_OUTPUT = 32
# Claude Code 2.1.197's default tools are about 64 KB of JSON schema, over 34,000 tokens for the
# tiny model's small vocabulary: more than its 32,768-token context. A few tools keep the prompt
# at about 8,000 tokens; the Agent tool is among them because it makes Claude Code send a
# mid-conversation `role: system` message (its list of agent types).
CLAUDE_TOOLS = ("--tools", "Bash,Read,Edit,Write,Agent", "--")


@pytest.fixture(scope="module")
def harness_bin():
    return require_harnesses()


def user_agent_prefix(preset: str, product: str) -> str:
    return f"{product}/{HARNESS_PACKAGES[preset][1]}"


def recorded_ok(gateway, rollout: dict, protocol: str, agent: str) -> list[dict]:
    """The rollout's calls: at least one, each a successful `protocol` call of the harness with
    its engine token ids and aligned logprobs."""
    calls = gateway.calls(rollout["rollout_id"])
    assert calls, "the harness made no model call"
    for call in calls:
        assert call["status"] == "ok", call["error"]
        assert call["protocol"] == protocol
        assert call["user_agent"].startswith(agent), call["user_agent"]
        assert call["prompt_ids"] and call["completion_ids"]
        assert len(call["logprobs"]) == len(call["completion_ids"]) == len(call["versions"])
    return calls


def overlong_prompt(tokenizer) -> str:
    """More tokens than the engine's context by itself (about one token per character)."""
    text = " ".join(f"{i:x}" for i in range(TINY_MAX_MODEL_LEN // 4 + 2000))
    assert len(tokenizer(text)["input_ids"]) > TINY_MAX_MODEL_LEN
    return text


def all_refused(gateway, rollout: dict) -> None:
    calls = gateway.calls(rollout["rollout_id"])
    assert calls and all(c["status"] == "failed" and not c["completion_ids"] for c in calls)
    assert all("maximum context length" in c["error"] for c in calls), calls[0]["error"]


def test_claude_code(gateway, vllm_server, tiny_tokenizer, harness_bin, tmp_path):
    rollout = gateway.new_rollout(task_id="claude-code")
    harness = Harness(preset="claude-code", model=vllm_server.model,
                      max_output_tokens=CLAUDE_MAX_OUTPUT, extra_args=CLAUDE_TOOLS)
    run = run_harness(harness_bin, harness, PROMPT, rollout, tmp_path, TIMEOUT_S)
    assert run.returncode is not None, run.describe()
    calls = recorded_ok(gateway, rollout, "anthropic", user_agent_prefix("claude-code",
                                                                        "claude-cli"))
    # A reply cut at max_tokens makes Claude Code ask the model to resume, up to three times,
    # and then exit 1; the random tiny model rarely ends a reply within 32 tokens.
    if run.returncode != 0:
        assert run.returncode == 1, run.describe()
        assert [c["finish_reason"] for c in calls] == ["length"] * 4, run.describe()
        assert "output token maximum" in run.stdout, run.describe()
    first = calls[0]["request"]
    assert first["stream"] is True and first["max_tokens"] == CLAUDE_MAX_OUTPUT
    assert any(m["role"] == "system" for m in first["messages"]), "mid-conversation system"
    # Its per-request billing header line is in the request and not in what the engine saw.
    system_text = "".join(block["text"] for block in first["system"])
    assert "x-anthropic-billing-header" in system_text
    prompt_text = tiny_tokenizer.decode(calls[0]["prompt_ids"])
    assert "x-anthropic-billing-header" not in prompt_text
    assert PROMPT in prompt_text


def test_claude_code_prompt_too_long(gateway, vllm_server, tiny_tokenizer, harness_bin,
                                     tmp_path):
    rollout = gateway.new_rollout(task_id="claude-code-overflow")
    harness = Harness(preset="claude-code", model=vllm_server.model,
                      max_output_tokens=CLAUDE_MAX_OUTPUT, extra_args=CLAUDE_TOOLS)
    run = run_harness(harness_bin, harness, overlong_prompt(tiny_tokenizer), rollout, tmp_path,
                      TIMEOUT_S)
    # Claude Code recognises Anthropic's "prompt is too long" error (it would compact a longer
    # conversation; a single overlong message it cannot) and says so.
    assert run.returncode == 1, run.describe()
    assert "prompt is too long" in run.stdout.lower(), run.describe()
    all_refused(gateway, rollout)


def test_codex(gateway, vllm_server, tiny_tokenizer, harness_bin, tmp_path):
    rollout = gateway.new_rollout(task_id="codex")
    harness = Harness(preset="codex", model=vllm_server.model)
    run = run_harness(harness_bin, harness, PROMPT, rollout, tmp_path, TIMEOUT_S)
    assert run.returncode == 0, run.describe()
    calls = recorded_ok(gateway, rollout, "responses", user_agent_prefix("codex", "codex_exec"))
    first = calls[0]["request"]
    assert first["stream"] is True and first["store"] is False
    # Codex prints the final agent message: the text of the last call's sampled ids (special
    # tokens kept: it offers tools with tool_choice auto), after its own clean-up of line endings
    # and spaces, so whitespace is not compared. When the tiny model samples a `<tool_call>` tag
    # (never followed by a valid call), vLLM's tool parser withholds the streamed text from there
    # on: the agent then sees less than was sampled, but never anything else.
    sampled = "".join(engine_text(tiny_tokenizer, calls[-1], skip_special_tokens=False).split())
    shown = "".join(run.stdout.split())
    if "<tool_call>" in sampled:
        assert sampled.startswith(shown), run.describe()
    else:
        assert shown == sampled, run.describe()


def test_codex_context_window_exceeded(gateway, vllm_server, tiny_tokenizer, harness_bin,
                                       tmp_path):
    rollout = gateway.new_rollout(task_id="codex-overflow")
    harness = Harness(preset="codex", model=vllm_server.model)
    run = run_harness(harness_bin, harness, overlong_prompt(tiny_tokenizer), rollout, tmp_path,
                      TIMEOUT_S)
    # Codex maps the `context_length_exceeded` code to its own message.
    assert run.returncode == 1, run.describe()
    assert "ran out of room in the model's context window" in run.stderr, run.describe()
    all_refused(gateway, rollout)


def test_opencode(gateway, vllm_server, tiny_tokenizer, harness_bin, tmp_path):
    rollout = gateway.new_rollout(task_id="opencode")
    harness = Harness(preset="opencode", model=vllm_server.model, max_output_tokens=32)
    run = run_harness(harness_bin, harness, PROMPT, rollout, tmp_path, TIMEOUT_S)
    assert run.returncode == 0, run.describe()
    calls = recorded_ok(gateway, rollout, "chat", user_agent_prefix("opencode", "opencode"))
    # A toolless title call and the agent turn, which offers OpenCode's tools.
    assert sorted(c["offered_tools"] for c in calls) == [False, True]
    [agent] = [c for c in calls if c["offered_tools"]]
    assert agent["request"]["stream"] is True
    assert agent["request"]["stream_options"] == {"include_usage": True}
