"""The stand-in's chat template and tokenizer: what it renders messages to, so that it can serve
vLLM's render endpoint (`/v1/chat/completions/render`) and echo the prompt ids of a rendered
conversation, as the gateway's exact continuation needs of an engine.

ChatML-shaped (`<|im_start|>role\\n content <|im_end|>\\n` per message, tools first, the
generation prompt an opened assistant turn), so, like the templates of real chat models, a
conversation renders as a prefix of its continuation. The tokenizer is a stand-in too: one id
per 4 bytes of text, so a context of N tokens is about 4N characters, as code and English run.
It costs the stand-in numpy work per message, never the gateway anything.
"""

from __future__ import annotations

import msgspec
import numpy as np

IM_START, IM_END, NL = 1, 2, 3
ROLES = {"system": 4, "user": 5, "assistant": 6, "tool": 7, "developer": 8, "function": 9}
_FIRST_TEXT_ID = 16
_VOCAB = 50_000
_GENERATION = np.asarray([IM_START, ROLES["assistant"], NL], dtype=np.int64)


_vocab = [_VOCAB]  # ids of text: below _FIRST_TEXT_ID + this (set_vocab)


def set_vocab(size: int) -> None:
    """Keeps every rendered id below `size`, the vocabulary of a model that trains on them."""
    _vocab[0] = size - _FIRST_TEXT_ID
    _cache.clear()


def text_ids(text: str) -> np.ndarray:
    raw = text.encode()
    raw += b" " * (-len(raw) % 4)
    return np.frombuffer(raw, dtype="<u4").astype(np.int64) % _vocab[0] + _FIRST_TEXT_ID


def _content(message: dict) -> str:
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    text = content if isinstance(content, str) else ""
    if message.get("tool_calls"):
        text += msgspec.json.encode(message["tool_calls"]).decode()
    return text


def message_ids(message: dict) -> np.ndarray:
    role = ROLES.get(message.get("role"), ROLES["user"])
    return np.concatenate(([IM_START, role, NL], text_ids(_content(message)), [IM_END, NL])).astype(
        np.int64
    )


def render(body: dict) -> np.ndarray:
    """The prompt ids of a chat request (or a render request: `add_generation_prompt`)."""
    text, _ = render_json(body)
    return np.asarray(msgspec.json.decode(text), dtype=np.int64)


# message (as JSON) -> its ids as JSON text without brackets, and how many: a conversation's
# messages come again on each of its calls, and the stand-in must not be the bottleneck.
_cache: dict[bytes, tuple[bytes, int]] = {}
_CACHE_ENTRIES = 1 << 14


def _message_json(message: dict) -> tuple[bytes, int]:
    key = msgspec.json.encode(message)
    hit = _cache.get(key)
    if hit is None:
        ids = message_ids(message)
        hit = _cache[key] = (msgspec.json.encode(ids.tolist())[1:-1], ids.size)
        if len(_cache) > _CACHE_ENTRIES:
            del _cache[next(iter(_cache))]
    return hit


def render_json(body: dict) -> tuple[bytes, int]:
    """`render(body)` as a JSON array, and its length."""
    messages = list(body.get("messages") or ())
    if body.get("tools"):
        tools = msgspec.json.encode(body["tools"]).decode()
        messages.insert(0, {"role": "system", "content": tools})
    parts = [_message_json(m) for m in messages]
    if body.get("add_generation_prompt", True):
        parts.append((b"%d,%d,%d" % tuple(_GENERATION), _GENERATION.size))
    return b"[" + b",".join(p for p, _ in parts) + b"]", sum(n for _, n in parts)
