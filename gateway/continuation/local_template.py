"""Local rendering: the model's chat template run in the gateway with a tiktoken encoding built
from its byte-level BPE, tokenizing only the new part of a continued conversation. It only
approximates what the engine does, so it is used only where `checked_render` found it agrees."""

from __future__ import annotations

import json
import logging
import re
import unicodedata
from datetime import datetime
from pathlib import Path
from typing import Literal

import numpy as np

from gateway.byte_level import bytes_to_unicode
from gateway.continuation.rendering import TURN_END_TOKENS, Around, render_body, split_around

log = logging.getLogger(__name__)


class Unsupported(Exception):
    """The model's tokenizer or template is outside what local rendering reproduces."""


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


def _byte_level_bpe(spec: dict) -> tuple[dict, dict | None]:
    """The tokenizer's model and normalizer, if tiktoken can reproduce them."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback") or model.get("dropout"):
        raise Unsupported(f"tokenizer model {model.get('type')}")
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        raise Unsupported("subword affixes")
    normalizer = spec.get("normalizer")
    if normalizer is not None and normalizer.get("type") != "NFC":
        raise Unsupported(f"normalizer {normalizer.get('type')}")
    return model, normalizer


def _special(added: dict) -> str:
    """An added token's text, if it is matched as written (as tiktoken's special tokens are)."""
    if added.get("lstrip") or added.get("rstrip") or added.get("single_word"):
        raise Unsupported(f"added token {added['content']!r} strips or matches words")
    return added["content"]


def encoding_from_tokenizer_json(spec: dict):
    """A tiktoken encoding equal to a Hugging Face byte-level BPE `tokenizer.json`, the map from
    its token values to the model's ids, whether text is NFC-normalised first, and the special
    token strings. Merges become ranks (tiktoken merges the adjacent pair whose bytes rank
    lowest, which for a BPE vocabulary is the pair merged first); added tokens become special
    tokens, matched anywhere in the text before the BPE runs, as Hugging Face does."""
    import tiktoken

    model, normalizer = _byte_level_bpe(spec)
    pattern = _pattern(spec.get("pre_tokenizer"))
    to_byte = {c: b for b, c in bytes_to_unicode().items()}

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
        specials[_special(added)] = len(ids)
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
        import jinja2.nodes
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
CONTENT_FORMATS = ("openai", "string")


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


def _texts(content) -> list[str] | None:
    """A message's content as its texts, or None if it holds anything but text."""
    parts = [] if content is None else [content] if isinstance(content, str) else content
    texts = []
    for part in parts:
        if isinstance(part, str):
            texts.append(part)
        elif (isinstance(part, dict) and part.keys() == {"type", "text"}
              and part["type"] == "text" and isinstance(part["text"], str)):
            texts.append(part["text"])
        else:
            return None
    return texts


def conversation(messages: list[dict], content_format: str) -> list[dict] | None:
    """The messages the way vLLM passes text-only chat messages to a template (`openai`: content
    as text parts; `string`: parts joined by newlines), or None for what this does not cover."""
    out = []
    for m in messages:
        role = m.get("role")
        if role not in ("system", "user", "assistant", "tool"):
            return None
        texts = _texts(m.get("content"))
        if texts is None:
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

    def around(self, body: dict, upto: int, content_format: str) -> Around | None | Literal[False]:
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
        if self._specials is None or len(starts) < 2 or (tail and not self._specials.match(tail)):
            return split_around(self.encode(turn), self.encode(full), "local")
        # From the second-last special token: the turn's end whatever its template looks like.
        return Around(
            tuple(self.encode(turn[starts[-2] :])[-TURN_END_TOKENS:]), self.encode(tail), "local"
        )


