"""Merging through the real gateway and vLLM: a rollout's calls become exact training
sequences; drift, rewrites and side calls fork and are counted; storage is linear and
reconstructs the engine's prompts exactly; rollouts past their deadline are merged too."""

from __future__ import annotations

import time

import openai

TOOLS = [{
    "type": "function",
    "function": {
        "name": "run",
        "description": "Run a shell command",
        "parameters": {"type": "object", "required": ["cmd"], "additionalProperties": False,
                       "properties": {"cmd": {"type": "string", "enum": ["ls", "pwd", "make"]}}},
        "strict": True,  # schema-constrained arguments: valid calls even from the random model
    },
}]
FORCE = {"type": "function", "function": {"name": "run"}}


def _client(rollout) -> openai.OpenAI:
    return openai.OpenAI(base_url=rollout["openai_base_url"], api_key=rollout["api_key"],
                         max_retries=0, timeout=120)


def _extends(prev: dict, nxt: dict) -> bool:
    full = prev["prompt_ids"] + prev["completion_ids"]
    return nxt["prompt_ids"][: len(full)] == full


def test_five_turn_tool_conversation_merges_with_counted_drift(gateway, vllm_server):
    rollout = gateway.new_rollout(task_id="merge-5")
    client = _client(rollout)
    messages = [{"role": "system", "content": "You are an agent. Use tools."},
                {"role": "user", "content": "Build the project."}]
    engine_prompts = []
    for turn in range(5):
        resp = client.chat.completions.create(
            model=vllm_server.model, messages=messages, tools=TOOLS,
            tool_choice=FORCE if turn < 4 else "auto", max_tokens=400, parallel_tool_calls=False,
            extra_body={"return_token_ids": True})
        engine_prompts.append(resp.model_extra["prompt_token_ids"])
        msg = resp.choices[0].message
        messages.append({"role": "assistant", "content": msg.content,
                         "tool_calls": [tc.model_dump() for tc in msg.tool_calls or ()] or None})
        messages[-1] = {k: v for k, v in messages[-1].items() if v is not None}
        for tc in msg.tool_calls or ():
            messages.append({"role": "tool", "tool_call_id": tc.id, "content": f"ok {turn}"})
        if not msg.tool_calls:
            messages.append({"role": "user", "content": f"continue {turn}"})

    calls = gateway.calls(rollout["rollout_id"])
    # Storage: each call keeps only the tokens past its base; reconstruction is exact.
    assert [c["prompt_ids"] for c in calls] == engine_prompts
    assert sum(c["stored_prompt_tokens"] for c in calls[1:]) < sum(
        c["prompt_tokens"] for c in calls[1:])

    finish = gateway.finish(rollout["rollout_id"], 1.0).json()
    stats = finish["merge"]["stats"]
    drifts = sum(not _extends(a, b) for a, b in zip(calls, calls[1:]))
    assert stats["calls"] == 5
    assert stats["causes"]["drift"] == drifts
    assert stats["sequences"] == 1 + drifts
    assert stats["causes"]["rewrite"] == stats["causes"]["independent"] == 0
    sampled = sum(len(c["completion_ids"]) for c in calls)
    assert stats["trained_tokens"] == stats["sampled_tokens"] == sampled
    assert stats["lost_tokens"] == 0

    traces = gateway.admin.get(f"/admin/rollouts/{rollout['rollout_id']}/traces").json()
    assert traces["stats"] == stats
    by_id = {c["call_id"]: c for c in calls}
    trained_spans = 0
    for seq in traces["sequences"]:
        assert not seq["excluded"] and not seq["auxiliary"]
        ids, mask = seq["input_ids"], seq["loss_mask"]
        assert len(ids) == len(mask) == len(seq["logprobs"]) == len(seq["versions"])
        for call_id in seq["call_ids"]:
            call = by_id[call_id]
            start, n = len(call["prompt_ids"]), len(call["completion_ids"])
            # Same conditioning: the tokens before the span are exactly the engine's prompt.
            assert ids[:start] == call["prompt_ids"]
            assert ids[start:start + n] == call["completion_ids"]
            if mask[start:start + n] == [1] * n:
                trained_spans += 1
                assert seq["logprobs"][start:start + n] == call["logprobs"]
                assert seq["versions"][start:start + n] == call["versions"]
        assert sum(mask) == sum(
            len(by_id[c]["completion_ids"]) for c in seq["call_ids"]
            if seq["loss_mask"][len(by_id[c]["prompt_ids"])] == 1)
    assert trained_spans == 5  # every call trained exactly once


def _no_drift_pair(gateway, vllm_server):
    """A rollout whose second call extends its first (short replies rarely re-tokenize
    differently); a few attempts make this reliable with the random tiny model."""
    for attempt in range(12):
        rollout = gateway.new_rollout(task_id="merge-rewrite")
        client = _client(rollout)
        messages = [{"role": "system", "content": "Agent."},
                    {"role": "user", "content": f"Task number {attempt}."}]
        for turn in range(2):
            msg = client.chat.completions.create(
                model=vllm_server.model, messages=messages, tools=TOOLS, max_tokens=2,
            ).choices[0].message
            messages += [{"role": "assistant", "content": msg.content or ""},
                         {"role": "user", "content": f"Next step {turn}."}]
        first, second = gateway.calls(rollout["rollout_id"])
        if _extends(first, second):
            return rollout, client, messages
        gateway.finish(rollout["rollout_id"], None)
    raise AssertionError("no drift-free pair of turns in 12 attempts")


def test_rewritten_history_forks_as_rewrite_and_side_call_is_auxiliary(gateway, vllm_server):
    rollout, client, messages = _no_drift_pair(gateway, vllm_server)
    # The harness edits history (compaction): the user turn after the first reply is rewritten,
    # so the prompt diverges in context that follows a sampled (and drift-free) turn.
    edited = messages[:3] + [{"role": "user", "content": "A summary of everything so far."}]
    client.chat.completions.create(model=vllm_server.model, messages=edited, tools=TOOLS,
                                   max_tokens=4)
    # A side call with its own prompt and no tools (a title generator).
    client.chat.completions.create(
        model=vllm_server.model, max_tokens=4,
        messages=[{"role": "system", "content": "Write a title."},
                  {"role": "user", "content": "Conversation about a task."}])
    stats = gateway.finish(rollout["rollout_id"], 0.0).json()["merge"]["stats"]
    assert stats["causes"]["rewrite"] == 1
    assert stats["causes"]["independent"] == 1
    assert stats["causes"]["drift"] == 0
    traces = gateway.admin.get(f"/admin/rollouts/{rollout['rollout_id']}/traces").json()
    aux = [s for s in traces["sequences"] if s["auxiliary"]]
    assert len(aux) == 1 and aux[0]["excluded"] and aux[0]["cause"] == "independent"
    assert sum(aux[0]["loss_mask"]) == 0
    assert stats["lost_tokens"] == 0


def test_rollout_past_its_deadline_ends_as_timeout_and_is_merged(gateway, vllm_server):
    rollout = gateway.new_rollout(timeout_s=1)
    _client(rollout).chat.completions.create(
        model=vllm_server.model, tools=TOOLS, max_tokens=4,
        messages=[{"role": "user", "content": "slow agent"}])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        state = gateway.admin.get(f"/admin/rollouts/{rollout['rollout_id']}").json()
        if state["merge"]:
            break
        time.sleep(0.5)
    assert state["status"] == "timeout" and state["reward"] is None
    assert state["merge"]["stats"]["calls"] == 1
    r = gateway.admin.get(f"/admin/rollouts/{rollout['rollout_id']}/traces")
    assert r.status_code == 200 and len(r.json()["sequences"]) == 1


def test_traces_of_a_running_rollout_are_not_ready(gateway):
    rollout = gateway.new_rollout()
    r = gateway.admin.get(f"/admin/rollouts/{rollout['rollout_id']}/traces")
    assert r.status_code == 409 and r.json()["error"]["code"] == "not_merged"


def test_plain_chat_trains_and_a_side_call_only_rollout_says_why_it_trains_nothing(
    gateway, vllm_server
):
    title = [{"role": "system", "content": "Write a title."},
             {"role": "user", "content": "Conversation about a task."}]
    # Created without a word on side calls: a toolless call is the policy's work.
    plain = gateway.new_rollout(task_id="qa")
    _client(plain).chat.completions.create(model=vllm_server.model, messages=title, max_tokens=4)
    stats = gateway.finish(plain["rollout_id"], 1.0).json()["merge"]["stats"]
    assert stats["trained_tokens"] == stats["sampled_tokens"] > 0
    assert stats["auxiliary_sequences"] == 0

    # A tool-using harness (the runner's presets say so) that died after its title call.
    side = gateway.new_rollout(task_id="agent", side_calls="toolless")
    _client(side).chat.completions.create(model=vllm_server.model, messages=title, max_tokens=4)
    summary = gateway.finish(side["rollout_id"], 0.0).json()
    stats = summary["merge"]["stats"]
    assert stats["trained_tokens"] == 0 and stats["auxiliary_sequences"] == 1
    assert stats["excluded_by_cause"]["auxiliary"] == stats["excluded_tokens"] > 0
    assert summary["merge"]["options"]["side_calls"] == "toolless"
    assert summary["trained_nothing"].startswith(
        f"trained nothing: {stats['excluded_tokens']} sampled tokens excluded as auxiliary")
    assert "--train-auxiliary" in summary["trained_nothing"]

    bad = gateway.admin.post("/admin/rollouts", json={"side_calls": "sometimes"})
    assert bad.status_code == 400 and "side_calls" in bad.json()["error"]["message"]
