"""A two-call coding agent for the `python` preset: write the file, run it, show the model what
running it printed, take its revised file.

    rolltap rollouts tasks.jsonl --harness python --agent sandbox.agents.code_reviser:run ...

The first call is `code_writer`'s. Its file is then run (`python FILE`, a few seconds at most)
and the second call continues the same conversation with that output, so the gateway records
two calls of which the second extends the first exactly: a rollout the merge joins into one
training sequence, with the run's output as context between the sampled parts. The last code
block of the second reply (else of the first) is the file that is graded.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from sandbox.agents.code_writer import (
    MAX_TOKENS,
    REPLY_FILE,
    SYSTEM,
    extract_code,
    target_file,
    user_message,
)

RUN_TIMEOUT_S = 10
OUTPUT_CHARS = 1500


def run_output(path: Path) -> str:
    """What running the file printed (stdout and stderr, the tail), or that it printed nothing."""
    try:
        done = subprocess.run([sys.executable, "-I", path.name], cwd=path.parent,
                              capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
        text = (done.stdout + done.stderr).strip()
        status = f"exit status {done.returncode}"
    except subprocess.TimeoutExpired:
        text, status = "", f"still running after {RUN_TIMEOUT_S} s, stopped"
    return f"({status})\n{text[-OUTPUT_CHARS:]}" if text else f"({status}, no output)"


def revise_message(path: Path, output: str) -> str:
    return (f"I ran `python {path.name}`:\n```\n{output}\n```\nFix any error. Answer with the "
            "complete final content of the file in one ```python code block.")


def run(*, prompt: str, base_url: str, api_key: str, model: str, workdir: str) -> None:
    from openai import OpenAI  # the SDK is only needed inside the sandbox

    path = target_file(workdir)
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=1, timeout=600)
    # Plain dicts, as the SDK sends them (its TypedDicts are for literals).
    messages: list[Any] = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": user_message(prompt, path)}]
    replies = []
    for turn in range(2):
        response = client.chat.completions.create(model=model, max_tokens=MAX_TOKENS,
                                                  messages=messages)
        reply = response.choices[0].message.content or ""
        replies.append(reply)
        code = extract_code(reply)
        if code is not None:
            path.write_text(code)
        if turn == 0:
            messages += [{"role": "assistant", "content": reply},
                         {"role": "user", "content": revise_message(path, run_output(path))}]
    Path(workdir, REPLY_FILE).write_text("\n\n---\n\n".join(replies))
