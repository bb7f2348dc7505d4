"""A Harbor agent for the tests (loaded by import path, `--harness
harbor:tests.agents.harbor_answer_agent:AnswerAgent`), cheap enough to run a group of trials on
the tiny model: it runs in the Harbor worker, and in its trial's sandbox it asks the model for
an answer once through the gateway, offering a `submit` tool so the call is an agent turn the
bridge trains, with the rollout's key (the only credential the agent phase gets), and writes
what the model said to /app/answer.txt for the task's verifier. Runs in Harbor's venv only.
"""

from __future__ import annotations

import shlex

from harbor.agents.base import BaseAgent
from harbor.environments.base import BaseEnvironment
from harbor.models.agent.context import AgentContext

# Runs inside the sandbox, where the agent phase's environment holds OPENAI_BASE_URL and
# OPENAI_API_KEY (the rollout's); its arguments are the model and the instruction.
ASK = r"""
import json, os, sys, urllib.request

base, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]

def call(path, body=None):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode() if body else None,
                                 headers={"Authorization": f"Bearer {key}",
                                          "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)

model, instruction = sys.argv[1:3]
tool = {"type": "function", "function": {
    "name": "submit", "description": "Submit the answer.",
    "parameters": {"type": "object", "properties": {"answer": {"type": "string"}}}}}
reply = call("/chat/completions", {
    "model": model, "max_tokens": 16, "tools": [tool],
    "messages": [{"role": "user", "content": instruction}]})["choices"][0]["message"]
calls = reply.get("tool_calls") or []
answer = calls[0]["function"]["arguments"] if calls else reply.get("content") or ""
open("/app/answer.txt", "w").write(answer)
"""


class AnswerAgent(BaseAgent):
    @staticmethod
    def name() -> str:
        return "rolltap-test-answer"

    def version(self) -> str:
        return "1"

    async def setup(self, environment: BaseEnvironment) -> None:
        pass

    async def run(self, instruction: str, environment: BaseEnvironment,
                  context: AgentContext) -> None:
        result = await environment.exec(
            f"python3 -c {shlex.quote(ASK)} {shlex.quote(self.model_name or '')} "
            f"{shlex.quote(instruction)}", timeout_sec=300)
        if result.return_code != 0:
            raise RuntimeError(f"the answer script failed: {result.stderr}")
