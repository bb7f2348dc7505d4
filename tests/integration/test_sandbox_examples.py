"""The example task set scores what it should, and the scripted example agent works through
the OpenAI SDK.

Reference solutions score 1.0 and the untouched starting files 0.0 on every example task, so
the hidden tests are neither trivially passed nor impossible. The scripted agent is driven by a
STAND-IN chat endpoint that replies with one fixed write_file tool call and then plain text: it
checks the agent's tool handling, not any model.
"""

from __future__ import annotations

import asyncio
import json
import textwrap
from pathlib import Path

import pytest
from aiohttp import web

from sandbox.backends.base import RolloutAccess, SandboxRequest
from sandbox.backends.local import LocalBackend
from sandbox.presets import Harness
from tests.support.examples import SOLUTIONS, TASKS, writer

REPO = Path(__file__).resolve().parents[2]
ACCESS = RolloutAccess("r", "rk-examples", "http://127.0.0.1:9/v1", "http://127.0.0.1:9")


async def test_examples_score_one_when_solved_and_zero_when_not():
    assert set(SOLUTIONS) == set(TASKS)
    backend = LocalBackend()
    idle = Harness(preset="command", model="m", command="true")
    runs = [backend.run(SandboxRequest(TASKS[tid], writer(*SOLUTIONS[tid]), ACCESS))
            for tid in sorted(TASKS)]
    runs += [backend.run(SandboxRequest(TASKS[tid], idle, ACCESS)) for tid in sorted(TASKS)]
    results = await asyncio.gather(*runs)
    solved, untouched = results[: len(TASKS)], results[len(TASKS):]
    for tid, result in zip(sorted(TASKS), solved):
        assert result.reward == 1.0, (tid, result.verifier.output)
        assert result.verifier.total >= 5, tid
    for tid, result in zip(sorted(TASKS), untouched):
        assert result.reward == 0.0, (tid, result.verifier.output)


@pytest.fixture
async def stand_in_model():
    """A stand-in chat endpoint: a write_file tool call first, then a plain answer."""
    requests: list[dict] = []
    path, code = SOLUTIONS["fizzbuzz"]

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        requests.append({"auth": request.headers.get("Authorization"), "body": body})
        if len(requests) == 1:
            message = {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function", "function": {
                    "name": "write_file",
                    "arguments": json.dumps({"path": path, "content": textwrap.dedent(code)}),
                }}]}
            finish = "tool_calls"
        else:
            message, finish = {"role": "assistant", "content": "Done."}, "stop"
        return web.json_response({
            "id": f"chatcmpl-{len(requests)}", "object": "chat.completion", "created": 0,
            "model": body["model"],
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
        })

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}", requests
    await runner.cleanup()


async def test_scripted_agent_carries_out_tool_calls(stand_in_model, tmp_path):
    url, requests = stand_in_model
    access = RolloutAccess("r", "rk-scripted", f"{url}/v1", url)
    root = tmp_path / "sandboxes"
    root.mkdir()
    harness = Harness(preset="python", model="tiny", agent="sandbox.agents.scripted:run")
    result = await LocalBackend(root=str(root), keep_dirs=True).run(
        SandboxRequest(TASKS["fizzbuzz"], harness, access))
    assert result.status == "ok", result.agent.stderr
    assert result.reward == 1.0, result.verifier.output
    assert len(requests) == 2
    assert all(r["auth"] == "Bearer rk-scripted" for r in requests)
    first, second = requests[0]["body"], requests[1]["body"]
    assert first["model"] == "tiny" and first["tools"][0]["function"]["name"] == "write_file"
    assert TASKS["fizzbuzz"].prompt in first["messages"][1]["content"]
    # The tool's result went back to the model in the second turn.
    assert second["messages"][-1]["role"] == "tool"
    assert second["messages"][-1]["content"].startswith("wrote ")
    (sandbox,) = root.iterdir()
    assert (sandbox / "agent" / "work" / "agent_reply.md").read_text() == "Done.\n"
