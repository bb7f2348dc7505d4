"""Request bodies decoded from an earlier request's layout (gateway/protocols/resumable.py):
always exactly what decoding the body whole gives, and resumed where a conversation goes on."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.protocols import anthropic, chat, responses
from gateway.protocols.errors import GatewayError
from gateway.protocols.resumable import Decoder

_text = st.text(st.characters(codec="utf-8"), max_size=40)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "tool"]), "content": _text}
)
# How harnesses write JSON: msgspec/Go compact, Python's default separators, indented.
_DUMPS = {
    "compact": msgspec.json.encode,
    "python": lambda o: json.dumps(o).encode(),
    "indented": lambda o: json.dumps(o, indent=2, ensure_ascii=False).encode(),
}


def _body(messages, head, tail) -> dict:
    return {**head, "messages": messages, **tail}


def _check(decoder: Decoder, raw: bytes, earlier) -> tuple:
    """decode(raw, earlier), asserting it equals decoding `raw` whole (or fails as it does)."""
    try:
        expected = msgspec.json.decode(raw, type=decoder.type)
    except msgspec.DecodeError as exc:
        with pytest.raises(type(exc)):
            decoder.decode(raw, earlier)
        return None, None
    body, layout = decoder.decode(raw, earlier)
    assert body == expected
    if layout is not None:
        assert layout.items is (body["messages"] if isinstance(body, dict) else body.messages)
        ends = [layout.raw.find(b"[", layout.opens)]
        assert ends[0] == layout.opens
        for item, end in zip(layout.items, layout.ends):
            assert msgspec.json.decode(layout.raw[ends[-1] + 1 : end].lstrip(b" \t\r\n,")) == (
                msgspec.to_builtins(item)
            )
            ends.append(end)
    return body, layout


@settings(max_examples=300, deadline=None)
@given(
    st.lists(_message, min_size=1, max_size=6),
    st.lists(_message, max_size=4),
    st.dictionaries(st.sampled_from(["model", "temperature"]), _text, max_size=2),
    st.dictionaries(st.sampled_from(["tools", "stream"]), _text, max_size=2),
    st.dictionaries(st.sampled_from(["tools", "stream"]), _text, max_size=2),
    st.sampled_from(sorted(_DUMPS)),
)
def test_a_conversation_going_on_decodes_as_whole(first, added, head, tail, new_tail, style):
    decoder = Decoder("messages", min_bytes=0)
    dumps = _DUMPS[style]
    _, layout = _check(decoder, dumps(_body(first, head, tail)), [])
    assert layout is not None
    body, later = _check(decoder, dumps(_body(first + added, head, new_tail)), [layout])
    if added:
        # Resumed: the earlier items are the very objects decoded before (all but the last,
        # whose end is where the new bytes start).
        assert all(a is b for a, b in zip(body["messages"][: len(first) - 1], layout.items))


@settings(max_examples=300, deadline=None)
@given(
    st.lists(_message, min_size=1, max_size=5),
    st.binary(max_size=30),
    st.integers(0, 400),
    st.integers(0, 400),
)
def test_any_bytes_after_a_shared_prefix_decode_as_whole(messages, junk, cut, drop):
    # Whatever follows the shared bytes (cut anywhere, garbage, a truncated body): the result
    # or the error is decoding the body whole.
    decoder = Decoder("messages", min_bytes=0)
    raw = msgspec.json.encode({"model": "m", "messages": messages, "stream": True})
    _, layout = _check(decoder, raw, [])
    cut = min(cut, len(raw))
    child = raw[:cut] + junk + raw[min(cut + drop, len(raw)) :]
    _check(decoder, child, [layout])


@pytest.mark.parametrize(
    "child",
    [
        # A later duplicate key wins: its array is decoded, not the earlier one plus the new.
        b'{"model":"m","messages":[{"role":"user","content":"a"},{"role":"user","content":"b"}]'
        b',"messages":[{"role":"user","content":"z"}]}',
        # A trailing comma: invalid, whatever the shared items.
        b'{"model":"m","messages":[{"role":"user","content":"a"},]}',
        # The same items again, nothing new: decoded whole.
        b'{"model":"m","messages":[{"role":"user","content":"a"}],"x":1}',
        # The shared item gains a field: it differs at its very last byte.
        b'{"model":"m","messages":[{"role":"user","content":"a","x":1},{"role":"user"}]}',
        # The array ends and another field holds the new item.
        b'{"model":"m","messages":[{"role":"user","content":"a"}],"more":[{"role":"user"}]}',
    ],
)
def test_tricky_children_decode_as_whole(child):
    decoder = Decoder("messages", min_bytes=0)
    _, layout = _check(decoder, b'{"model":"m","messages":[{"role":"user","content":"a"}]}', [])
    _check(decoder, child, [layout])


def test_an_earlier_body_with_duplicate_keys_lays_out_the_array_decoded():
    decoder = Decoder("messages", min_bytes=0)
    raw = b'{"messages":[{"role":"user","content":"x"}],"messages":[{"role":"user","content":"a"}]}'
    _, layout = _check(decoder, raw, [])
    child = raw[:-2] + b',{"role":"user","content":"b"}]}'
    body, _ = _check(decoder, child, [layout])
    assert body["messages"][0] is layout.items[0]


def test_typed_bodies_resume_too():
    decoder = Decoder("messages", anthropic.MessagesBody, min_bytes=0)
    turns = [{"role": "user", "content": "hi " * 50}, {"role": "assistant", "content": "yes"}]
    first = {"model": "m", "max_tokens": 5, "messages": turns[:1], "system": "s"}
    _, layout = _check(decoder, msgspec.json.encode(first), [])
    second = {**first, "messages": [*turns, {"role": "user", "content": "go on"}]}
    body, _ = _check(decoder, msgspec.json.encode(second), [layout])
    assert body.messages[0] is layout.items[0]


def test_short_bodies_are_decoded_whole():
    decoder = Decoder("messages")
    _, layout = decoder.decode(b'{"messages":[{"role":"user","content":"a"}]}')
    assert layout is None


@pytest.mark.parametrize(
    ("parent", "child"),
    [
        # A number is not self-delimiting: `1` is a prefix of `12`.
        (b'{"messages":[1]}', b'{"messages":[12,3]}'),
        (b'{"messages":[1, 2]}', b'{"messages":[1, 23, 4]}'),
        (b'{"messages":[true]}', b'{"messages":[true , false]}'),
    ],
)
def test_items_that_are_prefixes_of_others_decode_as_whole(parent, child):
    decoder = Decoder("messages", min_bytes=0)
    _, layout = _check(decoder, parent, [])
    _check(decoder, child, [layout])


def test_the_earlier_request_sharing_the_most_items_is_resumed():
    # Interleaved sub-agents: the newest request is another conversation's.
    decoder = Decoder("messages", min_bytes=0)

    def raw(*texts):
        return msgspec.json.encode({"messages": [{"role": "user", "content": t} for t in texts]})

    _, mine = _check(decoder, raw("task", "a", "b"), [])
    _, other = _check(decoder, raw("task", "x"), [])
    for earlier in ([other, mine], [mine, other]):
        body, layout = _check(decoder, raw("task", "a", "b", "c"), earlier)
        assert layout.resumed == 3 and body["messages"][1] is mine.items[1]
        assert layout.shared_with(mine.raw) == mine.ends[2]
        assert layout.shared_with(other.raw) == layout.kept().shared_with(mine.raw) == 0
    # An edited history: the items before the edit are resumed.
    body, layout = _check(decoder, raw("task", "A", "b", "c"), [mine, other])
    assert layout.resumed == 1


def test_another_protocols_layout_is_passed_over():
    # The same bytes decoded as another type of body: its items are not this body's.
    turns = [{"role": "user", "content": "hi " * 50}]
    first = msgspec.json.encode({"model": "m", "max_tokens": 5, "messages": turns})
    typed = Decoder("messages", anthropic.MessagesBody, min_bytes=0)
    plain = Decoder("messages", min_bytes=0)
    _, layout = _check(typed, first, [])
    second = msgspec.json.encode(
        {"model": "m", "max_tokens": 5, "messages": [*turns, {"role": "user", "content": "b"}]}
    )
    body, later = _check(plain, second, [layout])
    assert later.resumed == 0 and all(type(m) is dict for m in body["messages"])


_CALL_IDS = st.sampled_from(["c1", "c2", None])
_assistant = st.fixed_dictionaries(
    {"role": st.just("assistant"), "content": _text},
    optional={"tool_calls": st.lists(st.fixed_dictionaries({"id": _CALL_IDS}), max_size=2)},
)
_tool = st.fixed_dictionaries(
    {"role": st.just("tool"), "content": _text, "tool_call_id": _CALL_IDS}
)
_chat_message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": _text}),
    _assistant,
    _tool,
)
_wrong_message = st.one_of(
    st.fixed_dictionaries({"role": st.just("robot"), "content": _text}),
    st.fixed_dictionaries({"role": st.just("user"), "content": st.integers()}),
)
_TASK = {"role": "user", "content": "a long task " * 1500}  # past the resuming threshold


def _answer(parse, raw: bytes, earlier) -> tuple:
    """A protocol's `parse` of `raw`: (what it decoded, its layout), or the error it answers
    with."""
    try:
        return parse(raw, earlier)
    except GatewayError as err:
        return ("error", err.status, err.message, err.param), None


def _resumes_as_whole(parse, earlier: bytes, later: bytes, resumes: int | None) -> None:
    """`parse` answers `later` resumed from `earlier`'s layout as it answers it whole;
    `resumes`: how many items it takes from `earlier`, if it is to take all of them."""
    _, layout = _answer(parse, earlier, [])
    if layout is None:
        return  # the earlier request was refused: nothing is kept of it
    resumed, later_layout = _answer(parse, later, [layout.kept()])
    if resumes is not None:
        assert later_layout is None or later_layout.resumed == resumes
    assert resumed == _answer(parse, later, [])[0]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(_chat_message, max_size=3),
    st.one_of(st.none(), _assistant),
    st.lists(st.one_of(_tool, _chat_message, _wrong_message), min_size=1, max_size=4),
    st.integers(0, 5),
)
def test_chat_checks_only_new_messages_and_answers_as_checking_all(turns, reply, added, cut):
    # A resumed body's earlier messages passed the checks with their own request; the checks of
    # the new ones (a tool result answers the calls of an assistant message resumed, a wrong
    # field is named by its index in the request) give what checking the whole body gives.
    first = [_TASK, *turns, *([reply] if reply else [])]
    kept = first[: len(first) - cut]  # a history edited after the kept messages, if cut
    _resumes_as_whole(
        chat.parse,
        msgspec.json.encode({"model": "m", "messages": first}),
        msgspec.json.encode({"model": "m", "messages": [*kept, *added]}),
        None if cut else len(first),
    )


_TOOL_IDS = st.sampled_from(["t1", "t2"])
_block = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": _text}),
    st.fixed_dictionaries(
        {"type": st.just("tool_use"), "id": _TOOL_IDS, "name": st.just("bash"),
         "input": st.dictionaries(st.sampled_from(["cmd", "n"]), _text, max_size=2)}
    ),  # fmt: skip
    st.fixed_dictionaries(
        {"type": st.just("tool_result"), "tool_use_id": _TOOL_IDS, "content": _text}
    ),
    st.just({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}),
)
_anthropic_message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "assistant", "system"]),
        "content": st.one_of(_text, st.lists(_block, max_size=3)),
    }
)


@settings(max_examples=400, deadline=None)
@given(
    st.lists(_anthropic_message, max_size=5),
    st.lists(_anthropic_message, min_size=1, max_size=4),
    st.sampled_from(["the task", "x-anthropic-billing-header: cch=1;\nthe task"]),
    st.integers(0, 5),
)
def test_anthropic_translates_only_new_turns_and_answers_as_translating_all(
    first, added, system, cut
):
    # The turns a resumed body shares whole with the earlier one are taken from its
    # translation; a new message of the same role as the last one joins its turn, which is
    # translated again. The system prompt (a per-call billing line) is always translated anew.
    def raw(messages, system):  # in Claude Code's order: the system prompt after the messages
        return msgspec.json.encode(
            {"model": "m", "messages": [_TASK, *messages], "system": system, "max_tokens": 8}
        )

    later = raw(first[: len(first) - cut] + added, system)  # an edited history, if cut
    _resumes_as_whole(
        anthropic.parse, raw(first, "the task"), later, None if cut else len(first) + 1
    )


def test_anthropic_takes_up_the_earlier_translation_of_shared_turns():
    def raw(*messages):
        return msgspec.json.encode(
            {"model": "m", "messages": [_TASK, *messages], "system": "s", "max_tokens": 8}
        )

    call = {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "bash", "input": {"cmd": "ls"}}
    ]}  # fmt: skip
    result = {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": "a b"}
    ]}  # fmt: skip
    first, layout = anthropic.parse(raw(call, result))
    later, later_layout = anthropic.parse(raw(call, result, call, result), [layout.kept()])
    assert later_layout.resumed == 3
    # The task and the first tool call are the very messages translated before; the system
    # prompt is translated anew.
    assert later.messages[1] is first.messages[1] and later.messages[2] is first.messages[2]
    assert later.messages == anthropic.parse(raw(call, result, call, result))[0].messages
    # A user message joining the last turn: that turn is translated again, as one turn.
    joined = {"role": "user", "content": "and then?"}
    later, _ = anthropic.parse(raw(call, result, joined), [layout.kept()])
    assert later.messages == anthropic.parse(raw(call, result, joined))[0].messages
    assert later.messages[-1] == {"role": "user", "content": "and then?"}
    assert later.messages[-2]["role"] == "tool"


_CALLS = st.sampled_from(["c1", "c2"])
_part = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text"]), "text": _text}),
    st.just({"type": "input_image", "image_url": "data:image/png;base64,"}),
)
_item = st.one_of(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "developer", "assistant"]),
         "content": st.one_of(_text, st.lists(_part, max_size=2))},
        optional={"type": st.just("message")},
    ),  # fmt: skip
    st.fixed_dictionaries(
        {"type": st.just("function_call"), "call_id": _CALLS, "name": st.just("shell"),
         "arguments": _text}
    ),  # fmt: skip
    st.fixed_dictionaries(
        {"type": st.just("function_call_output"), "call_id": _CALLS, "output": _text}
    ),
    st.fixed_dictionaries(
        {"type": st.just("reasoning"), "summary": st.just([]),
         "content": st.lists(st.fixed_dictionaries(
             {"type": st.just("reasoning_text"), "text": _text}), max_size=1)}
    ),  # fmt: skip
    st.just({"type": "function_call", "call_id": 3}),  # wrong types
)
_RESPONSES_TASK = {"role": "user", "content": "a long task " * 1500}


@settings(max_examples=400, deadline=None)
@given(
    st.lists(_item, max_size=5), st.lists(_item, min_size=1, max_size=4), _text, st.integers(0, 5)
)
def test_responses_translate_only_new_items_and_answer_as_translating_all(first, added, text, cut):
    # Items after the last one that left no assistant turn open are translated again (a new
    # reasoning or call item joins that turn); a wrong item is named by its index in the input.
    def raw(items):
        return msgspec.json.encode(
            {"model": "m", "instructions": text, "input": [_RESPONSES_TASK, *items]}
        )

    later = raw(first[: len(first) - cut] + added)  # an edited history, if cut
    _resumes_as_whole(responses.parse, raw(first), later, None if cut else len(first) + 1)


def test_responses_take_up_the_earlier_translation():
    def raw(*items):
        return msgspec.json.encode({"model": "m", "input": [_RESPONSES_TASK, *items]})

    call = {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": "{}"}
    output = {"type": "function_call_output", "call_id": "c1", "output": "ok"}
    first, layout = responses.parse(raw(call, output))
    later, later_layout = responses.parse(raw(call, output, call, output), [layout.kept()])
    assert later_layout.resumed == 3
    assert later.messages[0] is first.messages[0] and later.messages[1] is first.messages[1]
    assert later.body.input[1] is first.body.input[1]
    assert later == responses.parse(raw(call, output, call, output))[0]
    # Parallel calls: an output answers a call from before the point translation takes up at.
    second = {**call, "call_id": "c2"}
    first, layout = responses.parse(raw(call, second, output))
    later, _ = responses.parse(raw(call, second, output, {**output, "call_id": "c2"}), [layout])
    assert [m["role"] for m in later.messages] == ["user", "assistant", "tool", "tool"]
