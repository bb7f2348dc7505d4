"""A later call's request read by each protocol, by the length of the agent's history: decoded,
checked and translated to chat messages, from scratch (as a first call is) and resumed from the
previous request of its conversation (gateway/protocols/resumable.py), which only reads what
the call adds. Printed by the gateway section (`bench/gateway_contexts.py`).

Each history is TURNS tool steps after a task of about 5,000 tokens, written as its harness
writes it: Claude Code's Anthropic messages (a text and a tool_use block, then a tool_result),
Codex's Responses items (reasoning, a function call, its output) and chat messages.
"""

from __future__ import annotations

import msgspec

from gateway.protocols import anthropic, chat, responses

TURNS = (10, 100, 200)
_TASK = "Fix the failing test in src/parser.py. " * 500
_OUTPUT = "line of tool output\n" * 15


def _chat(turns: int) -> tuple[dict, str]:
    messages = [{"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": _TASK}]  # fmt: skip
    for i in range(turns):
        messages.append({"role": "assistant", "content": f"Step {i}: looking.", "tool_calls": [
            {"id": f"c{i}", "type": "function",
             "function": {"name": "bash", "arguments": f'{{"cmd": "ls src/{i}"}}'}}]})  # fmt: skip
        messages.append({"role": "tool", "tool_call_id": f"c{i}", "content": _OUTPUT})
    return {"model": "m", "messages": messages}, "messages"


def _anthropic(turns: int) -> tuple[dict, str]:
    messages = [{"role": "user", "content": _TASK}]
    for i in range(turns):
        messages.append({"role": "assistant", "content": [
            {"type": "text", "text": f"Step {i}: looking."},
            {"type": "tool_use", "id": f"t{i}", "name": "Bash", "input": {"cmd": f"ls src/{i}"}},
        ]})  # fmt: skip
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": f"t{i}", "content": _OUTPUT}]})  # fmt: skip
    system = "x-anthropic-billing-header: cch=1;\nYou are Claude Code."
    return {"model": "m", "messages": messages, "system": system, "max_tokens": 8}, "messages"


def _responses(turns: int) -> tuple[dict, str]:
    items = [{"role": "user", "content": _TASK}]
    for i in range(turns):
        items.append({"type": "reasoning", "summary": [],
                      "content": [{"type": "reasoning_text", "text": f"Step {i}."}]})  # fmt: skip
        items.append({"type": "function_call", "call_id": f"c{i}", "name": "shell",
                      "arguments": f'{{"command": ["ls", "src/{i}"]}}'})  # fmt: skip
        items.append({"type": "function_call_output", "call_id": f"c{i}", "output": _OUTPUT})
    return {"model": "m", "instructions": "You are Codex.", "input": items}, "input"


def _read(proto, raw: bytes, earlier: list) -> None:
    req, _ = proto.parse(raw, earlier)
    proto.to_upstream(req)


PROTOCOLS = (("chat", chat, _chat), ("anthropic", anthropic, _anthropic),
             ("responses", responses, _responses))  # fmt: skip


def table() -> str:
    from bench.gateway_contexts import best_us  # (which prints this table)

    head = f"{'request read':<22}" + "".join(f"{f'{t} turns':>22}" for t in TURNS)
    lines = [head, f"{'':<22}" + "".join(f"{'whole / resumed':>22}" for _ in TURNS)]
    for name, proto, history in PROTOCOLS:
        cells = []
        for turns in TURNS:
            body, field = history(turns)
            step = len(body[field]) - (3 if name == "responses" else 2)  # the last tool step
            earlier = msgspec.json.encode({**body, field: body[field][:step]})
            later = msgspec.json.encode(body)
            _, layout = proto.parse(earlier)
            kept = [layout.kept()]
            calls = [(_read, proto, later, []), (_read, proto, later, kept)]
            whole, resumed = best_us(calls, 7, 5)
            cells.append(f"{f'{whole:.0f} / {resumed:.0f} µs':>22}")
        lines.append(f"{name:<22}" + "".join(cells))
    lines.append("(a later call: its body decoded, checked and translated; best of 7 rounds)")
    return "\n".join(lines)
