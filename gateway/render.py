"""Chat messages to prompt token ids with the model's chat template, without generating.

`EngineRenderer` asks the replica (`POST /v1/chat/completions/render`, served by vLLM started
with `--enable-scale-out`): the ids are by construction the ones the engine would use, at the
cost of a round trip. `LocalTemplate` renders in the gateway with the model's chat template and
a tiktoken encoding built from its byte-level BPE, and tokenizes only the new part of a
continued conversation. It only approximates what the engine does (vLLM's message
preprocessing, Hugging Face's tokenizer), so `CheckedRenderer` uses it only for a replica and
model where it reproduced the engine's ids on a probe set, and for a request context (tools,
template settings) where it agreed with the engine on the first request; it cross-checks a
sample of later requests too, and stops using it for a context on any mismatch.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
import unicodedata
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import NamedTuple

import aiohttp
import msgspec
import numpy as np

from gateway import engine_ids
from gateway.continuation import CONTEXT_FIELDS, context_key
from gateway.protocols.errors import GatewayError
from gateway.upstream import Upstreams

log = logging.getLogger(__name__)

RENDER_PATH = "/v1/chat/completions/render"
# Tokens kept from the end of the render up to the parent's reply: enough for any template's
# end of an assistant turn.
_TURN_END_TOKENS = 16


class RenderError(Exception):
    """The engine could not render a request (its message says why)."""


class Around(NamedTuple):
    """A request rendered around the reply it continues."""

    turn_end: tuple[int, ...]  # the last tokens of the render up to and including the reply
    tail: list[int]  # the render of the whole request past that point
    by: str  # engine | local
    window: str | None = None  # the window of the conversation rendered (render_window), if any

    def same_ids(self, other: Around) -> bool:
        """Whether two renders agree (a local one may keep fewer end tokens)."""
        a, b = self.turn_end, other.turn_end
        n = min(len(a), len(b))
        return self.tail == other.tail and a[len(a) - n :] == b[len(b) - n :]


# A request's messages as compact JSON (as msgspec encodes them), made when a render needs
# them: the caller may have them at hand, or encode them only for the renders that send them.
Encoded = Callable[[], bytes]


def render_body(body: dict, messages: list[dict] | msgspec.Raw, *, ending: str) -> dict:
    """A render request for `messages` with `body`'s template settings, ending as `body` ends
    (`ending="request"`: generation prompt or continued final message), with the generation
    prompt ("generation") or with neither ("none"). Sampling and tool-choice fields are left out:
    they do not change the prompt, and a forced tool choice would make the engine build a grammar
    for nothing."""
    out = {k: body[k] for k in CONTEXT_FIELDS if k in body}
    out["messages"] = messages
    if body.get("tool_choice") == "none":  # may drop the tools from the prompt
        out["tool_choice"] = "none"
    if ending == "request":
        for k in ("add_generation_prompt", "continue_final_message"):
            if k in body:
                out[k] = body[k]
    else:
        out["add_generation_prompt"] = ending == "generation"
    return out


def opening_messages(messages_json: bytes, messages: list, upto: int) -> bytes:
    """The JSON of `messages[:upto]` cut from `messages_json`, the compact JSON of all of them:
    the conversation is not encoded again for each render, only the messages past `upto`."""
    if upto >= len(messages):
        return messages_json
    if upto <= 0:
        return b"[]"
    rest = len(_encode(messages[upto:]))  # `[` + the rest's items + `]`, after a comma
    return messages_json[: len(messages_json) - rest] + b"]"


def split_around(turn: list[int], full: list[int], by: str) -> Around | None:
    """`full` cut after `turn`; None if it does not start with `turn` (the template renders the
    earlier conversation differently once more messages follow)."""
    n = len(turn)
    if len(full) < n or full[:n] != turn:
        return None
    return Around(tuple(turn[-_TURN_END_TOKENS:]), full[n:], by)


_COMMA = ord(",")


class _Rendered(msgspec.Struct):
    token_ids: msgspec.Raw


_decode_rendered = msgspec.json.Decoder(_Rendered).decode


def split_spans(turn: bytes, full: bytes, by: str) -> Around | None:
    """`split_around` of two renders as the engine wrote them (JSON id arrays), without turning
    the conversation into Python ints: when the turn's text opens the full one's up to a comma,
    their ids agree that far, and only the turn's last ids and the tail are parsed. Otherwise
    (a rewritten history, or arrays written with other spacing) both are parsed whole."""
    t, f = turn[1:-1], full[1:-1]
    if not (t.strip() and f.startswith(t) and (len(f) == len(t) or f[len(t)] == _COMMA)):
        return split_around(engine_ids.parse(turn).tolist(), engine_ids.parse(full).tolist(), by)
    end = t.rsplit(b",", _TURN_END_TOKENS)[-_TURN_END_TOKENS:]
    return Around(
        tuple(int(x) for x in end),
        engine_ids.parse(b"[" + f[len(t) + 1 :] + b"]").tolist(),
        by,
    )


_encode = msgspec.json.encode


async def side_by_side(first: Awaitable, second: Awaitable) -> tuple:
    """(await first, await second), run concurrently with one task (gather makes two; a task
    costs tens of µs, and every continued call renders twice)."""
    task = asyncio.ensure_future(first)
    try:
        other = await second
    except BaseException:
        task.cancel()
        task.add_done_callback(_heard)  # a failure of its own adds nothing to this one
        raise
    return await task, other


def _heard(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


class EngineRenderer:
    def __init__(self, upstreams: Upstreams) -> None:
        self._upstreams = upstreams

    async def render(self, upstream: str, body: dict) -> list[int]:
        span = await self._span(upstream, body)
        try:
            return engine_ids.parse(span).tolist()
        except (msgspec.DecodeError, ValueError, TypeError, OverflowError) as exc:
            raise RenderError(f"{RENDER_PATH} answered unreadable ids: {exc}") from exc

    async def _span(self, upstream: str, body: dict) -> bytes:
        """The rendered ids as the engine wrote them: a JSON array."""
        try:
            resp = await self._upstreams.post(upstream, RENDER_PATH, _encode(body))
        except GatewayError as exc:
            raise RenderError(exc.message) from exc
        try:
            async with resp:
                raw = await resp.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise RenderError(f"{RENDER_PATH} broke off: {exc or type(exc).__name__}") from exc
        if resp.status != 200:
            raise RenderError(f"{RENDER_PATH} answered {resp.status}: {raw[:500]!r}")
        # The ids are cut out as text rather than decoded (they are most of the answer).
        rest, span = engine_ids.split(raw, "token_ids")
        try:
            rendered = msgspec.json.decode(rest)
            if not (
                isinstance(rendered, dict) and engine_ids.is_sentinel(rendered.get("token_ids"))
            ):
                span = bytes(_decode_rendered(raw).token_ids)  # the key came first elsewhere
        except msgspec.DecodeError as exc:
            raise RenderError(f"{RENDER_PATH} answered unreadable JSON: {exc}") from exc
        return span

    async def around(
        self, upstream: str, body: dict, upto: int, encoded: Encoded | None = None
    ) -> Around | None:
        """`body` rendered around its message `upto - 1` (the reply it continues);
        `encoded`: its messages' JSON, if the caller has it or makes it cheaper."""
        messages = body["messages"]
        messages_json = _encode(messages) if encoded is None else encoded()
        turn_json = opening_messages(messages_json, messages, upto)
        turn, full = await side_by_side(
            self._span(upstream, render_body(body, msgspec.Raw(turn_json), ending="none")),
            self._span(upstream, render_body(body, msgspec.Raw(messages_json), ending="request")),
        )
        try:
            return split_spans(turn, full, "engine")
        except (msgspec.DecodeError, ValueError, TypeError, OverflowError) as exc:
            raise RenderError(f"{RENDER_PATH} answered unreadable ids: {exc}") from exc


# -- local rendering ------------------------------------------------------------------------------


class Unsupported(Exception):
    """The model's tokenizer or template is outside what local rendering reproduces."""


def _bytes_to_unicode() -> dict[int, str]:
    """The byte <-> printable character table of byte-level BPE (GPT-2's)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


# GPT-2's pre-tokenizer pattern, which a ByteLevel pre-tokenizer with `use_regex` applies.
_GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def _pattern(pre: dict | None) -> str:
    if pre is None:
        raise Unsupported("no pre-tokenizer")
    if pre.get("type") == "ByteLevel":
        if pre.get("add_prefix_space") or not pre.get("use_regex", True):
            raise Unsupported("ByteLevel pre-tokenizer options")
        return _GPT2_PATTERN
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if (
        not steps
        or len(steps) != 2
        or steps[0].get("type") != "Split"
        or steps[0].get("behavior") != "Isolated"
        or steps[0].get("invert")
        or "Regex" not in (steps[0].get("pattern") or {})
        or steps[1].get("type") != "ByteLevel"
        or steps[1].get("add_prefix_space")
        or steps[1].get("use_regex")
    ):
        raise Unsupported(f"pre-tokenizer {pre.get('type')}")
    return steps[0]["pattern"]["Regex"]


def encoding_from_tokenizer_json(spec: dict):
    """A tiktoken encoding equal to a Hugging Face byte-level BPE `tokenizer.json`, the map from
    its token values to the model's ids, whether text is NFC-normalised first, and the special
    token strings. Merges become ranks (tiktoken merges the adjacent pair whose bytes rank
    lowest, which for a BPE vocabulary is the pair merged first); added tokens become special
    tokens, matched anywhere in the text before the BPE runs, as Hugging Face does."""
    import tiktoken

    model = spec.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback") or model.get("dropout"):
        raise Unsupported(f"tokenizer model {model.get('type')}")
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        raise Unsupported("subword affixes")
    normalizer = spec.get("normalizer")
    if normalizer is not None and normalizer.get("type") != "NFC":
        raise Unsupported(f"normalizer {normalizer.get('type')}")
    pattern = _pattern(spec.get("pre_tokenizer"))
    to_byte = {c: b for b, c in _bytes_to_unicode().items()}

    def raw(token: str) -> bytes:
        try:
            return bytes(to_byte[c] for c in token)
        except KeyError:
            raise Unsupported(f"token {token!r} is not byte-level") from None

    vocab: dict[str, int] = model["vocab"]
    ranks: dict[bytes, int] = {}
    ids: list[int] = []
    reached: set[str] = set()

    def add(token: str) -> None:
        if raw(token) not in ranks:
            ranks[raw(token)] = len(ids)
            ids.append(vocab[token])
            reached.add(token)

    for token, _ in sorted(vocab.items(), key=lambda kv: kv[1]):
        if len(raw(token)) == 1:
            add(token)
    if len(ranks) != 256:
        raise Unsupported("the vocabulary lacks single bytes")
    for merge in model.get("merges") or ():
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        if left + right in vocab:
            add(left + right)
    added_tokens = spec.get("added_tokens") or ()
    if vocab.keys() - reached - {a["content"] for a in added_tokens}:
        raise Unsupported("vocabulary entries that no merge produces")
    specials: dict[str, int] = {}
    for added in added_tokens:
        if added.get("lstrip") or added.get("rstrip") or added.get("single_word"):
            raise Unsupported(f"added token {added['content']!r} strips or matches words")
        specials[added["content"]] = len(ids)
        ids.append(added["id"])
    encoding = tiktoken.Encoding(
        "rolltap-local", pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials
    )
    return encoding, np.asarray(ids, dtype=np.int64), normalizer is not None, list(specials)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # As Hugging Face's templates expect: no HTML escaping, options exposed.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _compile(template: str):
    """The template in an environment like the one Hugging Face renders chat templates in."""
    try:  # installed with vLLM and transformers, not required by the gateway itself
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as exc:
        raise Unsupported(f"jinja2 is needed to run chat templates: {exc}") from exc

    class Generation(jinja2.ext.Extension):
        """`{% generation %}` marks assistant text for training masks; rendering ignores it."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(
                lineno
            )

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateError as exc:
        raise Unsupported(f"chat template: {exc}") from exc


# How vLLM hands message content to a template, depending on what the template iterates over.
_CONTENT_FORMATS = ("openai", "string")


def _tool_call(call: dict) -> dict:
    """As vLLM hands a tool call to templates: arguments a JSON object, {} if they are none."""
    fn = call.get("function") or {}
    arguments = fn.get("arguments")
    if isinstance(arguments, str) and arguments:
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            arguments = None
    return {
        "id": call.get("id"),
        "type": call.get("type", "function"),
        "function": {
            "name": fn.get("name"),
            "arguments": arguments if isinstance(arguments, dict) else {},
        },
    }


def conversation(messages: list[dict], content_format: str) -> list[dict] | None:
    """The messages the way vLLM passes text-only chat messages to a template (`openai`: content
    as text parts; `string`: parts joined by newlines), or None for what this does not cover."""
    out = []
    for m in messages:
        role = m.get("role")
        if role not in ("system", "user", "assistant", "tool"):
            return None
        content = m.get("content")
        parts = [] if content is None else [content] if isinstance(content, str) else content
        texts = []
        for part in parts:
            if isinstance(part, str):
                texts.append(part)
            elif (
                isinstance(part, dict)
                and part.keys() == {"type", "text"}
                and part["type"] == "text"
            ):
                if not isinstance(part["text"], str):
                    return None
                texts.append(part["text"])
            else:
                return None
        msg: dict = {"role": role}
        if content_format == "openai" and role != "tool":
            msg["content"] = [{"type": "text", "text": t} for t in texts]
        else:
            msg["content"] = "\n".join(t for t in texts if t or content_format == "openai")
        if role == "assistant":
            if m.get("tool_calls"):
                msg["tool_calls"] = [_tool_call(c) for c in m["tool_calls"]]
            if m.get("reasoning") is not None:
                msg["reasoning"] = msg["reasoning_content"] = m["reasoning"]
        elif role == "tool" and "tool_call_id" in m:
            msg["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def _tool_dump(tool: dict) -> dict:
    """A tool as vLLM's request model dumps it for the template."""
    fn = tool.get("function") or {}
    dumped = {k: fn.get(k) for k in ("name", "description", "parameters")}
    for k in ("strict", "defer_loading"):
        if fn.get(k) is not None:
            dumped[k] = fn[k]
    extra = {k: v for k, v in tool.items() if k not in ("type", "function", "defer_loading")}
    return {
        "type": tool.get("type", "function"),
        "function": dumped,
        "defer_loading": tool.get("defer_loading"),
        **extra,
    }


class LocalTemplate:
    """A model's chat template and tokenizer, run in the gateway."""

    def __init__(self, template: str, tokenizer_json: dict, variables: dict) -> None:
        self._template = _compile(template)
        self._encoding, self._ids, self._nfc, specials = encoding_from_tokenizer_json(
            tokenizer_json
        )
        longest_first = sorted(specials, key=len, reverse=True)
        self._specials = re.compile("|".join(map(re.escape, longest_first))) if specials else None
        self._variables = variables

    @classmethod
    def from_model_dir(cls, path: Path) -> LocalTemplate:
        try:
            config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
            spec = json.loads((path / "tokenizer.json").read_text(encoding="utf-8"))
            jinja_file = path / "chat_template.jinja"
            template = (
                jinja_file.read_text(encoding="utf-8")
                if jinja_file.exists()
                else config.get("chat_template")
            )
        except (OSError, ValueError) as exc:
            raise Unsupported(f"cannot read the tokenizer in {path}: {exc}") from exc
        if not isinstance(template, str):
            raise Unsupported("no single chat template")
        variables = {}
        for name in ("bos", "eos", "unk", "sep", "pad", "cls", "mask"):
            value = config.get(f"{name}_token")
            if isinstance(value, dict):
                value = value.get("content")
            if value is not None:
                variables[f"{name}_token"] = value
        if config.get("additional_special_tokens"):
            variables["additional_special_tokens"] = config["additional_special_tokens"]
        try:
            return cls(template, spec, variables)
        except (KeyError, TypeError, ValueError) as exc:  # a tokenizer.json of another shape
            raise Unsupported(f"tokenizer in {path}: {exc!r}") from exc

    def text(self, body: dict, content_format: str) -> str | None:
        """The prompt text of a render request (see `render_body`); None if the request uses
        something local rendering does not reproduce (the engine renders it then)."""
        if any(k in body for k in ("chat_template", "documents", "continue_final_message")):
            return None
        if body.get("tool_choice") == "none" and body.get("tools"):
            return None
        messages = conversation(body["messages"], content_format)
        if messages is None:
            return None
        tools = body.get("tools")
        return self._template.render(
            messages=messages,
            tools=[_tool_dump(t) for t in tools] if tools else None,
            documents=None,
            add_generation_prompt=body.get("add_generation_prompt", True),
            **self._variables,
            **(body.get("chat_template_kwargs") or {}),
        )

    def encode(self, text: str) -> list[int]:
        if self._nfc:
            text = unicodedata.normalize("NFC", text)
        ranks = self._encoding.encode(text, allowed_special="all")
        return self._ids[ranks].tolist()

    def render(self, body: dict, content_format: str) -> list[int] | None:
        text = self.text(body, content_format)
        return None if text is None else self.encode(text)

    def around(self, body: dict, upto: int, content_format: str) -> Around | None | bool:
        """As `EngineRenderer.around`, or False if the request is not for local rendering.

        Tokenizing at a special token gives the same ids as tokenizing the text around it
        (the tokenizer splits there first), so when the new part starts with one only the new
        part and the end of the earlier turn are tokenized: the cost follows the turn, not the
        conversation."""
        turn = self.text(render_body(body, body["messages"][:upto], ending="none"), content_format)
        full = self.text(render_body(body, body["messages"], ending="request"), content_format)
        if turn is None or full is None:
            return False
        if not full.startswith(turn):
            return None
        tail = full[len(turn) :]
        starts = [m.start() for m in self._specials.finditer(turn)] if self._specials else []
        if len(starts) < 2 or (tail and not self._specials.match(tail)):
            return split_around(self.encode(turn), self.encode(full), "local")
        # From the second-last special token: the turn's end whatever its template looks like.
        return Around(
            tuple(self.encode(turn[starts[-2] :])[-_TURN_END_TOKENS:]), self.encode(tail), "local"
        )


# A few conversation shapes, each rendered with and without a generation prompt and with and
# without a tool: what a replica and model must reproduce before local rendering is used for them.
_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "probe",
        "description": "A probe.",
        "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
    },
}
_PROBES = (
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}],
    [{"role": "user", "content": "Hi   there\n\n  friend\t!"}],
    [
        {
            "role": "user",
            "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "2"}],
        },
        {"role": "assistant", "content": "a b", "refusal": None},
        {"role": "user", "content": "cafe\u0301 \u00e9t\u00e9 \u4e2d\u6587 \U0001f600"},
    ],
    [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "",
            "reasoning": "hmm",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "probe", "arguments": '{ "x" :  "y"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ],
)


class Crosscheck:
    """Where a cheaper render (`what`) may stand in for the reference one (`reference`).

    Per key (an upstream and request context, and whatever else the cheaper render depends on):
    unknown until a request there is rendered both ways, then trusted while the two agree. One
    in `sample_every` later uses is checked again in the background, one in twice as many after
    each check that agrees, down to one in `8 * sample_every` (a reference render costs what the
    cheaper one saves: at 32k tokens, milliseconds); one disagreement ends the cheaper render's
    use for that key and brings the checks back to one in `sample_every`."""

    def __init__(
        self, what: str, reference: str, sample_every: int = 32, keys: int = 4096
    ) -> None:
        self._what = what
        self._reference = reference
        self._sample_every = sample_every
        self._interval = self._due = sample_every
        # Bounded, the least recently used forgotten first: a forgotten key is learnt again at
        # the cost of one more reference render, while requests of endless new shapes (a
        # hostile harness) would otherwise grow it without end.
        self._keys: OrderedDict[Hashable, bool] = OrderedDict()
        self._max_keys = keys
        self._checks: set[asyncio.Task] = set()
        self.stats = {"used": 0, "checked": 0, "mismatches": 0}

    def trusted(self, key: Hashable) -> bool | None:
        found = self._keys.get(key)
        if found is not None:
            self._keys.move_to_end(key)
        return found

    def _set(self, key: Hashable, trusted: bool) -> None:
        self._keys[key] = trusted
        self._keys.move_to_end(key)
        while len(self._keys) > self._max_keys:
            self._keys.popitem(last=False)

    def judge(self, key: Hashable, cheap: Around | None, reference: Around | None) -> None:
        same = (reference is None and cheap is None) or (
            reference is not None and cheap is not None and reference.same_ids(cheap)
        )
        self.stats["checked"] += 1
        if same:
            if key not in self._keys:
                log.info("%s agrees with %s at %s; used there", self._what, self._reference,
                         _describe(key))
            self._set(key, True)
        else:
            self.distrust(key, f"it differs from {self._reference}")

    def distrust(self, key: Hashable, why: str) -> None:
        self.stats["mismatches"] += 1
        self._set(key, False)
        log.warning("%s not used at %s again: %s", self._what, _describe(key), why)

    def used(
        self,
        key: Hashable,
        cheap: Around | None,
        reference: Callable[[], Awaitable[Around | None]],
    ) -> None:
        """Counts a use of the cheaper render; the sampled ones are checked against
        `reference()` in the background (the call does not wait for it)."""
        self.stats["used"] += 1
        self._due -= 1
        if self._due > 0:
            return
        self._due = self._interval
        task = asyncio.create_task(self._sample(key, cheap, reference))
        self._checks.add(task)
        task.add_done_callback(self._checks.discard)

    async def _sample(self, key, cheap, reference) -> None:
        try:
            expected = await reference()
        except RenderError:
            return  # nothing learnt; a later sample checks again
        self.judge(key, cheap, expected)
        agreed = self._keys.get(key) is True
        self._interval = (
            min(self._interval * 2, 8 * self._sample_every) if agreed else self._sample_every
        )


def _describe(key: Hashable) -> str:
    parts = key if isinstance(key, tuple) else (key,)
    return " ".join(p.hex()[:12] if isinstance(p, bytes) else str(p) for p in parts)


class CheckedRenderer:
    """Local rendering where it has reproduced the engine, the engine everywhere else."""

    def __init__(self, engine: EngineRenderer, local: LocalTemplate, sample_every: int = 32):
        self._engine = engine
        self._local = local
        self._check = Crosscheck("local rendering", "the engine's", sample_every)
        self.stats = self._check.stats
        # (upstream, model) -> content format that reproduced the engine, or None
        self._models: dict[tuple[str, str], str | None] = {}
        self._model_locks: dict[tuple[str, str], asyncio.Lock] = {}
        # Rendering a long conversation with Jinja and tokenizing it takes milliseconds of CPU:
        # done on a thread of its own, the event loop goes on serving streams meanwhile. One
        # thread: the renders hold the GIL, more would only contend for it.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="rolltap-render")

    async def render(self, upstream: str, body: dict) -> list[int]:
        return await self._engine.render(upstream, body)

    async def self_check(self, upstream: str, model: str) -> str | None:
        """The content format in which local rendering reproduces `upstream`'s ids for `model`
        on every probe, or None; decided once per replica and model."""
        key = (upstream, model)
        if key in self._models:
            return self._models[key]
        async with self._model_locks.setdefault(key, asyncio.Lock()):
            if key in self._models:
                return self._models[key]
            bodies = [
                {"model": model, "messages": p, "add_generation_prompt": g}
                | ({"tools": [_PROBE_TOOL]} if tools else {})
                for p in _PROBES
                for g in (True, False)
                for tools in (False, True)
            ]
            expected = await asyncio.gather(*(self._engine.render(upstream, b) for b in bodies))
            found = None
            for fmt in _CONTENT_FORMATS:
                try:
                    if all(self._local.render(b, fmt) == e for b, e in zip(bodies, expected)):
                        found = fmt
                        break
                except Exception:  # noqa: BLE001 - a template that fails here is not used
                    log.exception("local rendering failed on a probe")
                    break
            if found is None:
                log.warning(
                    "local rendering differs from %s for %s; rendering there", upstream, model
                )
            self._models[key] = found
            return found

    async def around(
        self, upstream: str, body: dict, upto: int, encoded: Encoded | None = None
    ) -> Around | None:
        context = context_key(body)
        try:
            fmt = await self.self_check(upstream, body.get("model"))
        except RenderError:
            fmt = None
        key = (upstream, context)
        trusted = self._check.trusted(key)
        engine = functools.partial(self._engine.around, upstream, body, upto, encoded)
        if fmt is None or trusted is False:
            return await engine()
        try:
            local = await asyncio.get_running_loop().run_in_executor(
                self._executor, self._local.around, body, upto, fmt
            )
        except Exception:  # noqa: BLE001 - e.g. a template error: the engine says what is wrong
            log.exception("local rendering failed; asking the engine")
            local = False
        if local is False:
            return await engine()
        if trusted is None:  # a new context: the engine answers, and says whether to trust us
            reference = await engine()
            self._check.judge(key, local, reference)
            return reference
        self._check.used(key, local, engine)
        return local
