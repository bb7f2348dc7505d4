"""A one-turn coding agent for the `python` preset: chat, take the code, write the file.

    rolltap rollouts tasks.jsonl --harness python --agent sandbox.agents.code_writer:run ...

It shows the model the task and the Python file it has to complete, asks for the whole file in
one fenced code block, and writes the last such block over that file. Small models follow this
far more reliably than a tool-calling protocol, so the reward measures the code rather than the
tool-call format. The reply is kept in `agent_reply.md` for inspection.
"""

from __future__ import annotations

import re
from pathlib import Path

MAX_TOKENS = 300
REPLY_FILE = "agent_reply.md"

SYSTEM = (
    "You are an expert Python programmer. Complete the file the user shows you. Answer with "
    "the complete new content of the file in one ```python code block."
)

_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)(?:\n```|\Z)", re.S)


def extract_code(reply: str) -> str | None:
    """The last fenced code block of `reply` (an unclosed last fence counts: the reply may have
    been cut at the token limit), or None when there is none."""
    blocks = [b for b in _FENCE.findall(reply) if b.strip()]
    return blocks[-1].rstrip() + "\n" if blocks else None


def target_file(workdir: str | Path) -> Path:
    """The one Python file of the task's starting files, the file the agent completes."""
    files = sorted(p for p in Path(workdir).glob("*.py") if p.is_file())
    if len(files) != 1:
        raise ValueError(f"expected exactly one .py file in the workdir, found {len(files)}")
    return files[0]


def user_message(prompt: str, path: Path) -> str:
    return user_text(prompt, path.name, path.read_text())


def user_text(prompt: str, file_name: str, content: str) -> str:
    """The user turn for a task's prompt and the file to complete (also what the learning
    experiment's evaluation sends, so it asks exactly as training does)."""
    return f"{prompt}\n\n{file_name}:\n```python\n{content}```"


def run(*, prompt: str, base_url: str, api_key: str, model: str, workdir: str) -> None:
    from openai import OpenAI  # the SDK is only needed inside the sandbox

    path = target_file(workdir)
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=1, timeout=600)
    response = client.chat.completions.create(
        model=model, max_tokens=MAX_TOKENS,
        messages=[{"role": "system", "content": SYSTEM},
                  {"role": "user", "content": user_message(prompt, path)}],
    )
    reply = response.choices[0].message.content or ""
    Path(workdir, REPLY_FILE).write_text(reply)
    code = extract_code(reply)
    if code is not None:
        path.write_text(code)
