"""Real harness CLIs from npm (pinned in tests/support/harnesses.py), each run headless and offline
on one prompt against the real gateway and vLLM: every rollout gets recorded calls with the
engine's token ids over the harness's own protocol (Claude Code: Anthropic Messages; Codex:
Responses; OpenCode, Qwen Code, Pi: chat completions), and an overlong prompt comes back in a
form the harness itself recognises as "prompt too long". All five also run an example task
through `rolltap rollouts`, confined, with the gateway as their only network.

The tiny model's replies are nonsense; these tests check the protocol path, not the agent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sandbox.presets import NPM_EXECUTABLES, Harness
from tests.support.detokenize import engine_text
from tests.support.gateway import ADMIN_KEY
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
CLAUDE_TOOLS = ("--tools", "Bash,Read,Edit,Write,Agent")


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


REPO = Path(__file__).resolve().parents[2]
# preset -> (recorded protocol, user agent product, extra CLI arguments)
THROUGH_ROLLOUTS = {
    "claude-code": ("anthropic", "claude-cli",
                    [f"--harness-arg={a}" for a in CLAUDE_TOOLS]),
    "codex": ("responses", "codex_exec", []),
    "opencode": ("chat", "opencode", []),
    "qwen-code": ("chat", "QwenCode", []),
    "pi": ("chat", "", []),
}


@pytest.mark.parametrize("preset", sorted(THROUGH_ROLLOUTS))
def test_harness_through_rollouts_confined(preset, gateway, vllm_server, harness_bin,
                                           tmp_path):
    """`rolltap rollouts` runs the harness on an example task in a bwrap sandbox whose network
    reaches only the gateway: half of the presets through the gateway's own Unix socket, the
    others through the runner's relay to its TCP port. Its calls are recorded, the hidden tests
    score it, and the rollout says it was confined."""
    protocol, product, extra = THROUGH_ROLLOUTS[preset]
    state = tmp_path / "state.jsonl"
    via_socket = preset in ("opencode", "qwen-code", "pi")
    argv = [sys.executable, "-m", "sandbox.cli", str(REPO / "examples/tasks/tasks.jsonl"),
            "--task", "fizzbuzz", "--harness", preset, "--model", vllm_server.model,
            "--harness-bin", str(harness_bin / NPM_EXECUTABLES[preset]), "--group-size", "1",
            "--gateway", gateway.url, "--state", str(state), "--max-output-tokens", "32",
            "--sandbox-root", str(tmp_path / "sandboxes"), *extra]
    if via_socket:
        argv += ["--gateway-socket", str(gateway.unix_socket)]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "ROLLTAP_ADMIN_KEY": ADMIN_KEY})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "isolation: bwrap" in proc.stdout
    [record] = [json.loads(line) for line in state.read_text().splitlines()
                if json.loads(line)["type"] == "rollout"]
    rollout = gateway.admin.get(f"/admin/rollouts/{record['rollout_id']}").json()
    assert rollout["metrics"]["isolation"] == "bwrap", rollout["metrics"]
    calls = gateway.calls(record["rollout_id"])
    assert calls, f"no model call recorded: {rollout['metrics']}"
    ok = [c for c in calls if c["status"] == "ok"]
    assert ok and all(c["protocol"] == protocol for c in ok), rollout["metrics"]
    assert all(c["user_agent"].startswith(product) for c in ok), ok[0]["user_agent"]
    assert all(c["prompt_ids"] and len(c["logprobs"]) == len(c["completion_ids"]) for c in ok)
    assert record["reward"] is not None or rollout["metrics"]["sandbox_status"] != "ok"
