"""Normalisers for per-request nonces that harnesses put into prompts.

A nonce that changes on every call makes two calls of one conversation differ early in their
token sequences, so neither vLLM's prefix cache nor the trace merger (which extends a sequence
only on an exact token prefix) can reuse anything after it. Every protocol runs its upstream
chat messages through `normalize_messages` before they go to vLLM; each normaliser below names
the harness that needs it.

A normaliser works message by message (it may change or drop each one, whatever the others), so
a conversation's normalisation is its parts' normalisations joined: a protocol that translates
only a conversation's new turns normalises only those.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

Messages = list[dict[str, Any]]

_BILLING_PREFIX = "x-anthropic-billing-header:"
# The whole line goes, with the line breaks after it: `cc_version` carries a per-request
# suffix as well as `cch`, and the block separator after the line would otherwise leave the
# system prompt starting with blank lines.
_BILLING_LINE = re.compile(r"^x-anthropic-billing-header:[^\n]*\n*", re.MULTILINE)


def _strip_billing_text(text: str) -> str:
    if _BILLING_PREFIX not in text:
        return text
    return _BILLING_LINE.sub("", text)


def strip_claude_code_billing_header(messages: Messages) -> Messages:
    """Claude Code (2.1.x) opens its system prompt with a line
    `x-anthropic-billing-header: cc_version=2.1.117.48f; cc_entrypoint=cli; cch=71fea;` whose
    `cch` (and version suffix) are recomputed for every request. Removed from system messages
    only; a system message left empty is dropped."""
    out: Messages = []
    for message in messages:
        if message.get("role") != "system":
            out.append(message)
            continue
        content = message.get("content")
        if isinstance(content, str):
            stripped: Any = _strip_billing_text(content)
            keep = bool(stripped) or not content
        elif isinstance(content, list):
            stripped = []
            for part in content:
                text = part.get("text") if isinstance(part, dict) else None
                if isinstance(text, str) and _BILLING_PREFIX in text:
                    text = _strip_billing_text(text)
                    if text:
                        stripped.append({**part, "text": text})
                else:
                    stripped.append(part)
            keep = bool(stripped) or not content
        else:
            out.append(message)
            continue
        if stripped is not content and keep:
            message = {**message, "content": stripped}
        if keep:
            out.append(message)
    return out


# Each normaliser with the text it changes nothing without: a request body whose bytes hold
# none of these is passed over without a Python loop over its whole conversation, every call.
NORMALISERS: tuple[tuple[Callable[[Messages], Messages], bytes], ...] = (
    (strip_claude_code_billing_header, _BILLING_PREFIX.encode()),
)


def normalize_messages(messages: Messages, raw: bytes | None = None) -> Messages:
    """Apply every normaliser in order; returns a new list, the input is not modified. `raw`:
    the request body the messages come from, if at hand, to skip the normalisers whose text it
    does not hold. (JSON may spell ASCII letters as `\\u` escapes; no encoder does, and such a
    body is only left as it came.)"""
    out = messages
    for normaliser, text in NORMALISERS:
        if raw is None or text in raw:
            out = normaliser(out)
    return list(messages) if out is messages else out
