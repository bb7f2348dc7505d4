"""Request keys: which earlier call's request and reply a request's messages start with, as
rolling hashes of canonical messages under the request's rendering context (see the package's
docstring)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import msgspec

# Request fields (besides messages) that change how a chat template renders the conversation.
CONTEXT_FIELDS = (
    "model",
    "tools",
    "chat_template",
    "chat_template_kwargs",
    "reasoning_effort",
    "documents",
    "add_special_tokens",
)

_KEY_BYTES = 16
_encode = msgspec.json.Encoder(order="sorted").encode
_decode = msgspec.json.decode
_encode_compact = msgspec.json.encode


def _texts(content: Any) -> tuple[list, bool]:
    """Content as a list of texts (non-text parts kept whole) and whether any part is media."""
    if content is None:
        return [], False
    if isinstance(content, str):
        return ([content] if content else []), False
    if not isinstance(content, list):
        return [content], False
    out: list = []
    media = False
    for part in content:
        if isinstance(part, dict) and part.get("type") == "text":
            if part.get("text"):
                out.append(part["text"])
        else:
            media = True
            out.append(part)
    return out, media


def _arguments(arguments: Any) -> Any:
    """Tool-call arguments as a value: a JSON string is parsed, so formatting does not count."""
    if isinstance(arguments, (str, bytes)):
        try:
            return _decode(arguments)
        except msgspec.DecodeError:
            return ["unparsed", arguments]
    return arguments


def canonical_message(message: dict, *, reasoning: bool = True) -> tuple[bytes, bool, bool]:
    """(canonical bytes, has media content, exact) of one chat message. `exact`: a message
    Python's `==` calls equal to this one has the same canonical bytes. It does unless a value
    that goes into them as it is (not parsed from a string) holds a number or a boolean, where
    `==` calls 1, 1.0 and true equal, and 0.0 and -0.0."""
    texts, media = _texts(message.get("content"))
    calls, as_sent = [], []
    for call in message.get("tool_calls") or ():
        fn = call.get("function") or call
        arguments = fn.get("arguments")
        calls.append([fn.get("name"), _arguments(arguments)])
        as_sent.append([fn.get("name"), None if isinstance(arguments, str) else arguments])
    thought = (message.get("reasoning_content") or message.get("reasoning")) if reasoning else None
    form = [
        message.get("role"),
        texts,
        thought or None,
        calls,
        message.get("tool_call_id"),
        message.get("name"),
    ]
    exact = _no_numbers([*form[:3], as_sent, *form[4:]])
    return _encode(form), media, exact


def _no_numbers(value: Any) -> bool:
    """Whether `value` (decoded JSON) holds only strings, nulls, lists and objects."""
    stack = [value]
    while stack:
        v = stack.pop()
        kind = type(v)
        if kind is list:
            stack.extend(v)
        elif kind is dict:
            stack.extend(v.values())
        elif kind is not str and v is not None:
            return False
    return True


def _feed(h: Any, data: bytes) -> None:
    h.update(len(data).to_bytes(4, "little"))
    h.update(data)


def _context_hash(body: dict):
    h = hashlib.blake2b(digest_size=_KEY_BYTES)
    _feed(h, _encode([body.get(f) for f in CONTEXT_FIELDS]))
    return h


def context_key(body: dict) -> bytes:
    """Equal for requests whose conversations render alike (same model, tools, settings)."""
    return _context_hash(body).digest()


# A decoded message's dicts, lists and string headers beyond its JSON's bytes: 240-650 B in
# agent conversations (tracemalloc; more for many short fields, less for long tool outputs).
_OBJECTS_PER_MESSAGE = 512


class RequestKeys:
    """The continuation keys of one chat-completions request body.

    `keys[i]` is the key of the conversation up to and including the assistant message at
    `positions[i]`; only assistant messages followed by another message are candidates (a final
    assistant message is a prefill, not a reply to continue from).

    Rolling: given the keys of earlier requests of the rollout (`earlier`), the hashing resumes
    from the longest one whose messages open this request's, so only the new messages are
    hashed. Whether they open it is decided by `==` on the decoded messages (C-level, a memcmp
    per long string), and only from an earlier request whose messages are all `exact` (see
    `canonical_message`): so the keys are exactly the ones hashing from scratch gives.

    The messages are kept, not copied or encoded: bodies are not modified once decoded."""

    __slots__ = (
        "context", "keys", "positions", "media", "_end", "_messages", "_exact", "_size", "_json",
        "_open",
    )  # fmt: skip

    def __init__(self, body: dict, earlier: Iterable[RequestKeys] = ()) -> None:
        h = _context_hash(body)
        self.context = h.digest()
        messages = body.get("messages") or ()
        self._messages = messages
        self._json: bytes | None = None
        self.keys: list[bytes] = []
        self.positions: list[int] = []
        self.media = False
        self._exact = True
        self._size = 0
        start = 0
        parent = self._resumable(earlier)
        if parent is not None:
            h = parent._end.copy()
            self.keys = list(parent.keys)
            self.positions = list(parent.positions)
            self.media = parent.media
            self._size = parent._size
            start = len(parent._messages)
            if parent._open and start < len(messages):  # its final assistant turn is a reply now
                self.keys.append(h.copy().digest())
                self.positions.append(start - 1)
        for i in range(start, len(messages)):
            message = messages[i]
            data, media, exact = canonical_message(message)
            self.media |= media
            self._exact &= exact
            self._size += len(data)
            _feed(h, data)
            if message.get("role") == "assistant" and i + 1 < len(messages):
                self.keys.append(h.copy().digest())
                self.positions.append(i)
        self._open = bool(messages) and messages[-1].get("role") == "assistant"
        self._end = h

    def _resumable(self, earlier: Iterable[RequestKeys]) -> RequestKeys | None:
        """The earlier request with the most messages that open this one's, in the same context."""
        messages = self._messages
        best = None
        for other in earlier:
            n = len(other._messages)
            if not n or not other._exact or other.context != self.context or n > len(messages):
                continue
            if best is not None and n <= len(best._messages):
                continue
            if messages[:n] == other._messages:
                best = other
        return best

    def messages_json(self) -> bytes:
        """The request's messages as compact JSON (msgspec's encoding, as sent upstream), encoded
        when first asked for: an exact continuation sends and renders only the new messages."""
        if self._json is None:
            self._json = _encode_compact(self._messages)
        return self._json

    def holds(self, items: list) -> bool:
        """Whether `items` are the very messages these keys keep (the normalised list is
        another list of the same messages): the last one tells."""
        messages = self._messages
        return bool(items) and bool(messages) and items[-1] is messages[-1]

    @property
    def nbytes(self) -> int:
        """Memory kept for a later request's rolling keys (roughly: the messages' canonical
        size, which is about their JSON's, and the Python objects they are decoded into)."""
        return (
            self._size
            + _OBJECTS_PER_MESSAGE * len(self._messages)
            + (len(self._json) if self._json else 0)
            + 24 * len(self.keys)
            + 256
        )

    def reply_keys(self, reply: dict[str, Any]) -> list[bytes]:
        """Keys under which a later request finds the call that got this request and returned
        `reply`: as returned, and without its reasoning (harnesses that do not send it back)."""
        variants = [canonical_message(reply)[0]]
        bare = canonical_message(reply, reasoning=False)[0]
        if bare != variants[0]:
            variants.append(bare)
        keys = []
        for data in variants:
            h = self._end.copy()
            _feed(h, data)
            keys.append(h.digest())
        return keys

    def longest(self, known: Iterable[bytes]) -> int:
        """Index into `keys` of the longest key in `known`, or -1."""
        known = known if isinstance(known, (set, frozenset, dict)) else set(known)
        for i in range(len(self.keys) - 1, -1, -1):
            if self.keys[i] in known:
                return i
        return -1
