"""The chat-delta accumulator every protocol renders from (gateway/protocols/segments.py): any
split of one generation into chunks gives the same segments and events, the whole response read
once gives the same state as its stream, and each protocol's streamed events put back together
are its whole-response rendering."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.protocols import anthropic, responses, segments
from gateway.protocols.errors import GatewayError
from gateway.protocols.segments import Accumulator, Segment

TEXT = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=20)
ARGS = st.one_of(
    st.dictionaries(st.sampled_from("abc"), st.integers() | TEXT, max_size=3).map(json.dumps),
    TEXT,  # not JSON: a model's broken call
    st.just(""),
)
PROMPT_TOKENS = 11


@dataclass
class Call:
    call_id: str
    name: str
    arguments: str


@dataclass
class Generation:
    """One model reply: segments in the order vLLM sends them (reasoning, text, tool calls)."""

    reasoning: str
    content: str
    calls: list[Call]
    finish: str
    matched: Any  # vLLM's `stop_reason`
    usage: bool  # whether the engine sent its usage chunk


@st.composite
def generations(draw) -> Generation:
    calls = [
        Call(f"call_{i}", name, args)
        for i, (name, args) in enumerate(
            draw(st.lists(st.tuples(st.sampled_from(["exec", "agents__wait"]), ARGS), max_size=3))
        )
    ]
    finish = draw(st.sampled_from(["stop", "length"] + (["tool_calls"] if calls else [])))
    return Generation(
        reasoning=draw(st.just("") | TEXT),
        content=draw(st.just("") | TEXT),
        calls=calls,
        finish=finish,
        matched=draw(st.sampled_from([None, "###", 2])) if finish == "stop" else None,
        usage=draw(st.booleans()),
    )


@st.composite
def pieces(draw, text: str) -> list[str]:
    """`text` cut at arbitrary places; pieces may be empty, as a vLLM delta can be."""
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=5)))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def _chunk(delta: dict, tokens: itertools.count, finish: str | None = None, matched=None) -> dict:
    choice = {"index": 0, "delta": delta, "finish_reason": finish, "token_ids": [next(tokens)]}
    if finish is not None:
        choice["stop_reason"] = matched
    return {"object": "chat.completion.chunk", "choices": [choice]}


def _usage(completion: int) -> dict:
    return {
        "prompt_tokens": PROMPT_TOKENS,
        "completion_tokens": completion,
        "total_tokens": PROMPT_TOKENS + completion,
    }


@st.composite
def streams(draw, gen: Generation) -> list[dict]:
    """The chunks vLLM could send for `gen`, cut at arbitrary places."""
    tokens = itertools.count(1)
    chunks = [
        {
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
            "prompt_token_ids": list(range(PROMPT_TOKENS)),
        }
    ]
    chunks += [_chunk({"reasoning": p}, tokens) for p in draw(pieces(gen.reasoning))]
    chunks += [_chunk({"content": p}, tokens) for p in draw(pieces(gen.content))]
    for i, call in enumerate(gen.calls):
        first, *rest = draw(pieces(call.arguments))
        function = {"name": call.name, "arguments": first}
        start = {"index": i, "id": call.call_id, "type": "function", "function": function}
        chunks.append(_chunk({"tool_calls": [start]}, tokens))
        chunks += [
            _chunk({"tool_calls": [{"index": i, "function": {"arguments": p}}]}, tokens)
            for p in rest
        ]
    if len(chunks) > 1 and draw(st.booleans()):
        last = chunks[-1]["choices"][0]
        last["finish_reason"], last["stop_reason"] = gen.finish, gen.matched
    else:
        chunks.append(_chunk({}, tokens, gen.finish, gen.matched))
    if gen.usage:
        usage = _usage(next(tokens) - 1)  # every token id handed out so far
        chunks.append({"object": "chat.completion.chunk", "choices": [], "usage": usage})
    return chunks


def whole(gen: Generation) -> dict:
    """The chat completion vLLM returns for `gen` when not streaming, without its token counts
    (`with_counts` adds those of a stream)."""
    message: dict[str, Any] = {"role": "assistant", "content": gen.content or None}
    if gen.reasoning:
        message["reasoning"] = gen.reasoning
    if gen.calls:
        message["tool_calls"] = [
            {
                "id": c.call_id,
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for c in gen.calls
        ]
    return {
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": gen.finish,
                "stop_reason": gen.matched,
                "token_ids": [],
            }
        ],
        "prompt_token_ids": list(range(PROMPT_TOKENS)),
    }


def with_counts(resp: dict, chunks: list[dict]) -> dict:
    """`resp` with the token ids and usage of the stream `chunks`, as the engine counts them."""
    ids = [i for c in chunks for ch in c["choices"] for i in ch.get("token_ids") or ()]
    resp["choices"][0]["token_ids"] = ids
    usage = next((c["usage"] for c in chunks if c.get("usage")), None)
    if usage is not None:
        resp["usage"] = usage
    return resp


def state(acc: Accumulator) -> tuple:
    return (
        [(s.kind, s.index, s.text(), s.call_id, s.name) for s in acc.segments],
        acc.finish_reason(),
        acc.raw_finish,
        acc.matched,
        acc.usage,
        acc.output_tokens,
        acc.prompt_tokens,
    )


class Recorder(segments.Sink):
    def __init__(self) -> None:
        self.events: list[tuple] = []

    def start(self, seg: Segment) -> None:
        self.events.append(("start", seg.index, seg.kind, seg.call_id, seg.name))

    def delta(self, seg: Segment, text: str) -> None:
        self.events.append(("delta", seg.index, text))

    def end(self, seg: Segment) -> None:
        self.events.append(("end", seg.index))

    def finish(self) -> None:
        self.events.append(("finish",))

    def usage(self) -> None:
        self.events.append(("usage",))


def fed(chunks: list[dict]) -> tuple[Accumulator, Recorder]:
    acc, rec = Accumulator(), Recorder()
    for c in chunks:
        acc.feed(c, rec)
    return acc, rec


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_any_split_gives_the_state_of_the_whole_response(data):
    gen = data.draw(generations())
    chunks = data.draw(streams(gen))
    other = data.draw(streams(gen))
    streamed, _ = fed(chunks)
    once = Accumulator()
    once.feed(with_counts(whole(gen), chunks))
    assert state(streamed) == state(once)
    # Another split of the same generation: the same segments and the same finish.
    assert state(fed(other)[0])[:4] == state(streamed)[:4]


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_events_reassemble_into_the_segments(data):
    gen = data.draw(generations())
    chunks = data.draw(streams(gen))
    acc, rec = fed(chunks)
    starts = [e for e in rec.events if e[0] == "start"]
    assert [e[1:] for e in starts] == [(s.index, s.kind, s.call_id, s.name) for s in acc.segments]
    for seg in acc.segments:
        assert "".join(e[2] for e in rec.events if e[0] == "delta" and e[1] == seg.index) == (
            seg.text()
        )
    # A segment ends exactly when the next one starts, and the last one never ends.
    flow = [e[:2] for e in rec.events if e[0] in ("start", "end")]
    expected = [("start", 0)] if acc.segments else []
    for k in range(1, len(acc.segments)):
        expected += [("end", k - 1), ("start", k)]
    assert flow == expected
    assert rec.events.count(("finish",)) == 1
    assert rec.events.count(("usage",)) == int(gen.usage)
    if gen.usage:
        assert rec.events[-1] == ("usage",)


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_split_of_interleaved_kinds_is_invisible(data):
    """Any order of reasoning and text runs (a model may think again after writing): the same
    runs, whatever the chunks."""
    runs = data.draw(st.lists(st.tuples(st.sampled_from(["reasoning", "content"]), TEXT)))
    merged: list[list] = []
    for key, text in runs:
        if merged and merged[-1][0] == key:
            merged[-1][1] += text
        else:
            merged.append([key, text])

    def chunks_of(cut: bool) -> list[dict]:
        tokens = itertools.count()
        out = []
        for key, text in runs:
            parts = data.draw(pieces(text)) if cut else [text]
            out += [_chunk({key: p}, tokens) for p in parts]
        return out

    kinds = {"reasoning": segments.REASONING, "content": segments.TEXT}
    for cut in (False, True):
        acc, _ = fed(chunks_of(cut))
        assert [(s.kind, s.text()) for s in acc.segments] == [(kinds[k], t) for k, t in merged]


def test_finish_reasons_are_neutral():
    def reason(raw: str | None, calls: bool = False) -> str | None:
        acc = Accumulator()
        call = {"index": 0, "id": "c", "function": {"name": "f"}}
        delta = {"tool_calls": [call]} if calls else {}
        acc.feed({"choices": [{"delta": delta, "finish_reason": raw}]})
        return acc.finish_reason()

    assert [reason(r) for r in ("stop", "repetition", None, "length", "tool_calls")] == [
        segments.STOP,
        segments.STOP,
        segments.STOP,
        segments.LENGTH,
        segments.TOOL_CALLS,
    ]
    assert reason("stop", calls=True) == segments.TOOL_CALLS  # a call forced by tool_choice
    assert reason("length", calls=True) == segments.LENGTH
    assert reason("content_filter") == segments.CONTENT_FILTER
    assert reason("abort") is None


def test_whole_response_arguments_given_as_an_object_become_json_text():
    acc = Accumulator()
    call = {"id": "c", "function": {"name": "f", "arguments": {"city": "Paris"}}}
    acc.feed({"choices": [{"message": {"tool_calls": [call]}, "finish_reason": "tool_calls"}]})
    assert json.loads(acc.segments[0].text()) == {"city": "Paris"}


# -- each protocol: its stream put back together is its whole response -------------------------


def _anthropic_ctx() -> anthropic.Context:
    return anthropic.Context(model="tiny", message_id="msg_0", stop_sequences=("###",))


def _sse(raw: bytes) -> list[dict]:
    return [json.loads(f.split(b"\ndata: ", 1)[1]) for f in raw.split(b"\n\n") if f]


def _anthropic_message(events: list[dict]) -> dict:
    """What an Anthropic client builds from the events (as the SDK's stream helper does)."""
    message = events[0]["message"]
    partial: dict[int, str] = {}
    for ev in events[1:]:
        if ev["type"] == "content_block_start":
            message["content"].append(dict(ev["content_block"]))
        elif ev["type"] == "content_block_delta":
            block, delta = message["content"][ev["index"]], ev["delta"]
            if delta["type"] == "input_json_delta":
                partial[ev["index"]] = partial.get(ev["index"], "") + delta["partial_json"]
            else:
                key = "thinking" if delta["type"] == "thinking_delta" else "text"
                block[key] += delta[key]
        elif ev["type"] == "message_delta":
            message.update(ev["delta"])
            message["usage"]["output_tokens"] = ev["usage"]["output_tokens"]
    for index, text in partial.items():
        try:
            value = json.loads(text)
        except ValueError:
            value = {}
        message["content"][index]["input"] = value if isinstance(value, dict) else {}
    return message


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_anthropic_stream_reassembles_into_the_whole_message(data):
    gen = data.draw(generations())
    chunks = data.draw(streams(gen))
    stream = anthropic.Stream(_anthropic_ctx())
    raw = b"".join(stream.feed(c) for c in chunks) + stream.close()
    events = _sse(raw)
    assert [e["type"] for e in events][-1] == "message_stop"
    assert [e["type"] for e in events].count("message_delta") == 1
    rebuilt = _anthropic_message(events)
    expected = msgspec.json.decode(
        anthropic.from_upstream(with_counts(whole(gen), chunks), _anthropic_ctx())
    )
    assert rebuilt == expected


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_responses_stream_reassembles_into_the_whole_response(data):
    gen = data.draw(generations())
    chunks = data.draw(streams(gen))
    req = responses.parse_request(
        msgspec.json.encode({"model": "tiny", "input": "hi", "stream": True})
    )
    ctx = responses.to_upstream(req)[1]
    stream = responses.Stream(ctx)
    events = _sse(b"".join(stream.feed(c) for c in chunks) + stream.close())
    final = events[-1]["response"]
    # Each item's deltas add up to the item the final response holds.
    for k, item in enumerate(final["output"]):
        deltas = "".join(e["delta"] for e in events if e.get("output_index") == k and "delta" in e)
        assert deltas == (item["arguments"] if "arguments" in item else item["content"][0]["text"])
    assert msgspec.json.decode(responses.from_upstream(with_counts(whole(gen), chunks), ctx)) == (
        final
    )


def test_anthropic_refuses_an_engine_finish_it_cannot_express():
    stream = anthropic.Stream(_anthropic_ctx())
    stream.feed({"choices": [{"delta": {"content": "x"}, "finish_reason": "abort"}]})
    with pytest.raises(GatewayError) as caught:
        stream.close()
    assert caught.value.status == 502 and "abort" in caught.value.message


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_responses_failure_at_any_point_never_completes_a_call(data):
    """A stream cut anywhere: the items closed so far stay completed, the rest are incomplete,
    and no function call is announced done (a harness would run it)."""
    gen = data.draw(generations())
    chunks = data.draw(streams(gen))
    cut = data.draw(st.integers(0, len(chunks)))
    ctx = responses.to_upstream(
        responses.parse_request(msgspec.json.encode({"model": "tiny", "input": "hi"}))
    )[1]
    stream = responses.Stream(ctx)
    fed = b"".join(stream.feed(c) for c in chunks[:cut])
    events = _sse(fed + stream.fail(GatewayError(502, "upstream stream broke", "upstream_error")))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    done = {e["output_index"] for e in events if e["type"] == "response.output_item.done"}
    failed = events[-1]["response"]
    assert failed["status"] == "failed"
    for k, item in enumerate(failed["output"]):
        assert item["status"] == ("completed" if k in done else "incomplete")
        assert not (k in done and item["type"] == "function_call")
