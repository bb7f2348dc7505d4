"""A scripted example agent for the `python` preset: a few chat turns with one `write_file`
tool, through the gateway with the OpenAI SDK.

    rolltap rollouts tasks.jsonl --harness python --agent sandbox.agents.scripted:run ...

Every tool call the model makes is carried out in the workdir (paths that leave it are
refused and the refusal goes back to the model); a reply without tool calls ends the run, its
text saved to `agent_reply.md`. Malformed tool arguments, which small models produce often, are
answered with an error message instead of crashing the agent.
"""

from __future__ import annotations

import json
import os
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionToolParam

TURNS = 4
MAX_TOKENS = 512
REPLY_FILE = "agent_reply.md"

SYSTEM = (
    "You are a coding agent working in a project directory. Use the write_file tool to "
    "create or replace files. When you are done, answer without calling a tool."
)

WRITE_FILE: ChatCompletionToolParam = {
    "type": "function",
    "function": {
        "name": "write_file",
        "description": "Create or overwrite a file in the project directory.",
        "parameters": {
            "type": "object",
            "properties": {
                "path": {"type": "string", "description": "path relative to the project"},
                "content": {"type": "string", "description": "the whole new file content"},
            },
            "required": ["path", "content"],
        },
    },
}


def write_file(workdir: str, arguments: str) -> str:
    """Carry out one write_file call; returns what the model is told."""
    try:
        args = json.loads(arguments)
        path, content = args["path"], args["content"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return "error: arguments must be a JSON object with string fields path and content"
    if not isinstance(path, str) or not isinstance(content, str):
        return "error: path and content must be strings"
    rel = PurePosixPath(path)
    if rel.is_absolute() or ".." in rel.parts or str(rel) in ("", "."):
        return f"error: {path!r} is not a path inside the project"
    target = Path(workdir, *rel.parts)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(content)
    return f"wrote {len(content)} characters to {rel}"


def run(*, prompt: str, base_url: str, api_key: str, model: str, workdir: str) -> None:
    from openai import OpenAI  # the SDK is only needed inside the sandbox

    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=1)
    files = sorted(p for p in os.listdir(workdir) if not p.startswith("."))
    messages: list[Any] = [  # the SDK's message params, and its replies dumped
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"{prompt}\n\nFiles in the project: {', '.join(files)}"},
    ]
    for _ in range(TURNS):
        response = client.chat.completions.create(
            model=model, messages=messages, tools=[WRITE_FILE], max_tokens=MAX_TOKENS
        )
        message = response.choices[0].message
        calls = message.tool_calls or []
        messages.append(message.model_dump(exclude_none=True))
        if not calls:
            with open(Path(workdir, REPLY_FILE), "a") as fh:
                fh.write((message.content or "") + "\n")
            return
        for call in calls:
            if call.type != "function":  # a custom tool: none was offered
                result = f"error: unknown tool type {call.type!r}"
            elif call.function.name == "write_file":
                result = write_file(workdir, call.function.arguments)
            else:
                result = f"error: unknown tool {call.function.name!r}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
