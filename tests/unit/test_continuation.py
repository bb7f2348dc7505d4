"""Tests of the pure parts of exact continuation: detection of the call a request continues
(gateway.continuation), the splice, and the renderers (gateway.continuation)."""

from __future__ import annotations

import asyncio
import copy
import json
import threading

import msgspec
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from gateway.continuation import keys as keys_module
from gateway.continuation import splice as cont
from gateway.continuation.checked_render import CheckedRenderer
from gateway.continuation.keys import RequestKeys, canonical_message
from gateway.continuation.planner import Turn
from gateway.continuation.rendering import (
    Around,
    Crosscheck,
    RenderError,
    opening_messages,
    render_body,
    side_by_side,
    split_around,
    split_spans,
)
from gateway.continuation.splice import assistant_suffix, counts, splice
from gateway.continuation.window import WINDOWS, shape, window

TOOLS = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}}]

texts = st.text(alphabet='ab c\n{}"é', max_size=12)
args = st.dictionaries(st.sampled_from(["cmd", "path", "n"]), texts | st.integers(0, 9), max_size=3)


@st.composite
def replies(draw):
    """An assistant message as the gateway returned it (the captured chat-completions form)."""
    content = draw(st.none() | texts.filter(bool))
    calls = draw(st.lists(st.tuples(st.sampled_from(["run", "read"]), args), max_size=2))
    msg = {"role": "assistant", "content": content}
    if draw(st.booleans()):
        msg["reasoning_content"] = draw(texts.filter(bool))
    if calls:
        msg["tool_calls"] = [
            {
                "id": f"call-{draw(st.integers(0, 10**6))}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(a, separators=(",", ":"))},
            }
            for name, a in calls
        ]
    return msg


@st.composite
def echoes(draw, reply):
    """`reply` the way a harness sends it back: the same in substance, in another form."""
    msg: dict = {"role": "assistant"}
    content = reply["content"]
    form = draw(st.sampled_from(["as is", "parts", "empty"]))
    if content is None:
        msg["content"] = draw(st.sampled_from([None, "", []]))
    elif form == "parts":
        msg["content"] = [{"type": "text", "text": content}]
    else:
        msg["content"] = content
    if "reasoning_content" in reply:
        kept = draw(st.sampled_from(["reasoning", "reasoning_content", None]))
        if kept:
            msg[kept] = reply["reasoning_content"]
    if "tool_calls" in reply:
        msg["tool_calls"] = []
        for call in reply["tool_calls"]:
            a = json.loads(call["function"]["arguments"])
            spaced = json.dumps(
                dict(reversed(list(a.items()))), indent=draw(st.sampled_from([None, 2]))
            )
            msg["tool_calls"].append(
                {
                    "id": draw(st.sampled_from([call["id"], "toolu_other"])),
                    "type": "function",
                    "function": {"name": call["function"]["name"], "arguments": spaced},
                }
            )
    if draw(st.booleans()):
        msg.update(refusal=None, annotations=None)
    return msg


@st.composite
def followups(draw, reply):
    """What the harness adds after a reply: tool results for its calls, or a user message."""
    if reply.get("tool_calls"):
        return [
            {"role": "tool", "tool_call_id": c["id"], "content": draw(texts)}
            for c in reply["tool_calls"]
        ]
    text = draw(texts)
    return [
        {"role": "user", "content": draw(st.sampled_from([text, [{"type": "text", "text": text}]]))}
    ]


@st.composite
def conversations(draw, tag="", max_turns=5):
    """(requests, replies): request i is the conversation so far; reply i is what the gateway
    returned to it; request i + 1 extends request i with reply i echoed and the harness's turn."""
    messages = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": "sys" + tag})
    messages.append({"role": "user", "content": tag + draw(texts)})
    requests, returned = [], []
    for _ in range(draw(st.integers(1, max_turns))):
        requests.append({"model": "m", "tools": TOOLS, "messages": copy.deepcopy(messages)})
        reply = draw(replies())
        returned.append(reply)
        messages += [draw(echoes(reply)), *draw(followups(reply))]
    requests.append({"model": "m", "tools": TOOLS, "messages": copy.deepcopy(messages)})
    return requests, returned


def stored_keys(requests, returned) -> dict[bytes, int]:
    """Reply key -> turn index, as the gateway remembers calls."""
    known = {}
    for turn, (request, reply) in enumerate(zip(requests, returned)):
        for key in RequestKeys(request).reply_keys(reply):
            known[key] = turn
    return known


@settings(max_examples=300, deadline=None)
@given(conversations())
def test_each_request_continues_the_previous_call(conv):
    requests, returned = conv
    known = stored_keys(requests, returned)
    for turn in range(1, len(requests)):
        keys = RequestKeys(requests[turn])
        i = keys.longest(known)
        assert i >= 0 and known[keys.keys[i]] == turn - 1
        # The parent's request and reply cover exactly the messages up to its echoed reply.
        assert keys.positions[i] == len(requests[turn - 1]["messages"])


def same_keys(a: RequestKeys, b: RequestKeys, reply: dict) -> bool:
    return (a.context, a.keys, a.positions, a.media, a.reply_keys(reply)) == (
        b.context,
        b.keys,
        b.positions,
        b.media,
        b.reply_keys(reply),
    )


def variants(data, request: dict) -> dict:
    """`request` maybe changed the ways that must not resume from its predecessor: an earlier
    message edited (also to a value Python's == calls equal: 1 for 1.0 or true), other tools,
    an assistant prefill at the end, messages dropped."""
    out = copy.deepcopy(request)
    messages = out["messages"]
    change = data.draw(st.sampled_from(["none", "edit", "number", "tools", "prefill", "cut"]))
    if change == "edit":
        i = data.draw(st.integers(0, len(messages) - 1))
        messages[i] = {**messages[i], "content": data.draw(texts)}
    elif change == "number":
        i = data.draw(st.integers(0, len(messages) - 1))
        messages[i] = {**messages[i], "name": data.draw(st.sampled_from([1, 1.0, True]))}
    elif change == "tools":
        out["tools"] = []
    elif change == "prefill":
        messages.append({"role": "assistant", "content": data.draw(texts)})
    elif change == "cut":
        del messages[data.draw(st.integers(0, len(messages) - 1)) :]
    return out


@settings(max_examples=300, deadline=None)
@given(conversations(), st.data())
def test_rolling_keys_are_the_keys_from_scratch(conv, data):
    requests, returned = conv
    earlier: list[RequestKeys] = []
    for request in requests:
        request = variants(data, request)
        rolled = RequestKeys(request, earlier)
        assert same_keys(rolled, RequestKeys(request), returned[0])
        earlier = [*earlier[-3:], rolled]


def test_rolling_keys_resume_from_the_request_they_extend(monkeypatch):
    first = {
        "model": "m",
        "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
    }
    second = {"model": "m", "messages": [*first["messages"], {"role": "user", "content": "c"}]}
    hashed = []
    original = canonical_message
    monkeypatch.setattr(
        keys_module, "canonical_message", lambda m, **kw: hashed.append(m) or original(m, **kw)
    )
    earlier = RequestKeys(first)
    hashed.clear()
    rolled = RequestKeys(second, [earlier])
    assert hashed == [second["messages"][-1]]  # only the new message
    assert rolled.keys == RequestKeys(second).keys and rolled.positions == [1]


def test_rolling_keys_never_resume_across_values_python_calls_equal():
    # 1, 1.0 and true compare equal in Python and hash apart: no resuming over them.
    def request(name, more=()):
        return {"model": "m", "messages": [
            {"role": "user", "content": "a", "name": name},
            {"role": "assistant", "content": "b"}, *more]}  # fmt: skip

    for before, after in ((1, 1.0), (True, 1), (0.0, -0.0), ([1], [True])):
        first, second = request(before), request(after, [{"role": "user", "content": "c"}])
        assert first["messages"][0] == second["messages"][0]
        rolled = RequestKeys(second, [RequestKeys(first)])
        assert rolled.keys == RequestKeys(second).keys


def test_numbers_outside_the_keyed_fields_do_not_stop_resuming(monkeypatch):
    # A tool call's `index` (some harnesses send it back) is not part of a message's key.
    call = {"index": 0, "id": "c1", "function": {"name": "f", "arguments": '{"n": 1}'}}
    first = {"model": "m", "messages": [
        {"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [call]}]}  # fmt: skip
    second = {"model": "m", "messages": [
        *first["messages"], {"role": "tool", "tool_call_id": "c1", "content": "r"}]}  # fmt: skip
    earlier = RequestKeys(first)
    hashed = []
    original = canonical_message
    monkeypatch.setattr(
        keys_module, "canonical_message", lambda m, **kw: hashed.append(m) or original(m, **kw)
    )
    rolled = RequestKeys(second, [earlier])
    assert hashed == [second["messages"][-1]]
    assert rolled.keys == RequestKeys(second).keys


@settings(max_examples=300, deadline=None)
@given(conversations(), st.data())
def test_an_edit_before_a_reply_cuts_the_continuation_there(conv, data):
    requests, returned = conv
    known = stored_keys(requests, returned)
    final = copy.deepcopy(requests[-1])
    messages = final["messages"]
    j = data.draw(st.integers(0, len(messages) - 2))
    message = messages[j]
    if message.get("tool_calls"):
        fn = message["tool_calls"][0]["function"]
        fn["arguments"] = json.dumps({**json.loads(fn["arguments"]), "edited": 1})
    else:
        content = message.get("content")
        message["content"] = (content if isinstance(content, str) else "") + "!edited"
    keys = RequestKeys(final)
    i = keys.longest(known)
    assert i < 0 or keys.positions[i] < j  # only replies before the edit still match


@settings(max_examples=200, deadline=None)
@given(conversations(), st.data())
def test_changed_reasoning_is_not_the_reply(conv, data):
    requests, returned = conv
    with_reasoning = [t for t, r in enumerate(returned[:-1]) if "reasoning_content" in r]
    assume(with_reasoning)
    turn = data.draw(st.sampled_from(with_reasoning))
    known = stored_keys(requests, returned)
    final = copy.deepcopy(requests[turn + 1])
    echoed = final["messages"][len(requests[turn]["messages"])]
    echoed.pop("reasoning_content", None)
    echoed["reasoning"] = "something else"
    keys = RequestKeys(final)
    i = keys.longest(known)
    assert i < 0 or known[keys.keys[i]] < turn


@settings(max_examples=200, deadline=None)
@given(conversations())
def test_other_tools_or_model_never_continue(conv):
    requests, returned = conv
    assume(len(requests) > 1)
    known = stored_keys(requests, returned)
    for change in (
        {"tools": TOOLS + TOOLS},
        {"model": "other"},
        {"chat_template_kwargs": {"x": 1}},
    ):
        assert RequestKeys(requests[-1] | change).longest(known) == -1


@settings(max_examples=200, deadline=None)
@given(conversations("A:", 4), conversations("B:", 4), st.randoms(use_true_random=False))
def test_interleaved_sub_agents_each_continue_their_own_parent(a, b, rnd):
    # Calls of two conversations arrive interleaved in one rollout and share one index.
    order = ["a"] * (len(a[0]) - 1) + ["b"] * (len(b[0]) - 1)
    rnd.shuffle(order)
    known: dict[bytes, tuple[str, int]] = {}
    done = {"a": 0, "b": 0}
    for name in order:
        requests, returned = a if name == "a" else b
        turn = done[name]
        keys = RequestKeys(requests[turn])
        i = keys.longest(known)
        if turn == 0:
            assert i == -1
        else:
            assert known[keys.keys[i]] == (name, turn - 1)
        for key in keys.reply_keys(returned[turn]):
            known[key] = (name, turn)
        done[name] += 1


def test_first_turns_have_no_keys_and_a_final_assistant_is_no_candidate():
    assert RequestKeys({"messages": [{"role": "user", "content": "hi"}]}).keys == []
    prefill = RequestKeys(
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "Sure, "},
            ]
        }
    )
    assert prefill.keys == [] and prefill.positions == []


def test_media_content_is_flagged():
    image = {"type": "image_url", "image_url": {"url": "data:,"}}
    keys = RequestKeys({"messages": [{"role": "user", "content": [image]}]})
    assert keys.media
    assert not RequestKeys(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}
    ).media


def test_reply_keys_with_and_without_reasoning():
    request = RequestKeys({"messages": [{"role": "user", "content": "q"}]})
    assert len(request.reply_keys({"role": "assistant", "content": "a"})) == 1
    both = request.reply_keys({"role": "assistant", "content": "a", "reasoning_content": "r"})
    assert (
        len(both) == 2 and both[1] == request.reply_keys({"role": "assistant", "content": "a"})[0]
    )


# -- splice -----------------------------------------------------------------------------------

ids = st.lists(st.integers(0, 50), max_size=20)


@settings(max_examples=300, deadline=None)
@given(ids, st.lists(st.integers(51, 60), min_size=1, max_size=3), ids, ids, st.booleans())
def test_splice_extends_the_parent_with_the_turn_end_and_the_tail(
    parent, suffix, before, tail, ended
):
    # The parent stopped on the end-of-turn token, or was cut off (max_tokens) before it.
    parent_full = np.asarray(parent + suffix[:1] if ended else parent, dtype=np.int32)
    spliced, reason = splice(parent_full, before + suffix, tail, tuple(suffix))
    assert reason is None
    glue = suffix[1:] if ended else suffix
    assert spliced.tolist() == parent_full.tolist() + glue + tail


@settings(max_examples=200, deadline=None)
@given(ids, ids, ids, st.integers(0, 8))
def test_sampled_ids_follow_the_spliced_prompt_in_its_room(parent, tail, sampled, spare):
    # prompt + sampled ids, whether they fit the room the splice left or not, and only once:
    # a second call cannot overwrite ids an earlier result holds.
    prompt, _ = splice(np.asarray(parent, dtype=np.int32), [99], tail, (99,), spare)
    turn = Turn(RequestKeys({}), cont.ContinuationRecord(path="exact"), prompt_ids=prompt)
    completion = np.asarray(sampled, dtype=np.int32)
    full = turn.full(prompt, completion)
    assert full.tolist() == parent + [99] + tail + sampled
    assert np.shares_memory(full, prompt) == (len(sampled) <= spare)
    again = turn.full(prompt, completion[::-1].copy())
    assert full.tolist() == parent + [99] + tail + sampled
    assert again.tolist() == parent + [99] + tail + sampled[::-1]
    # Not the splice's prompt (the engine's own): always a copy.
    other = prompt.copy()
    assert not np.shares_memory(Turn(RequestKeys({}), turn.record).full(other, completion), other)


@settings(max_examples=200, deadline=None)
@given(ids, st.lists(st.integers(51, 60), min_size=1, max_size=3), ids, ids)
def test_splice_refuses_a_turn_that_ends_otherwise(parent, suffix, turn_end, tail):
    assume(turn_end[-len(suffix) :] != suffix)
    spliced, reason = splice(np.asarray(parent, dtype=np.int32), turn_end, tail, tuple(suffix))
    assert spliced is None and reason == cont.TURN_END
    assert splice(np.asarray(parent), turn_end, tail, ()) == (None, cont.TEMPLATE_PROBE)


@settings(max_examples=200, deadline=None)
@given(ids, ids, st.lists(st.integers(51, 60), min_size=1, max_size=3))
def test_assistant_suffix_is_what_an_empty_reply_adds(shared, generation_tail, suffix):
    # An empty assistant message renders as the opening the generation prompt has, then the end.
    opening = [61, 62]
    generation = shared + opening + generation_tail
    empty_turn = shared + opening + suffix
    found = assistant_suffix(generation, empty_turn)
    assert empty_turn[: len(empty_turn) - len(found)] + list(found) == empty_turn
    if not generation_tail:
        assert found == tuple(suffix)
    assert assistant_suffix(shared, shared) == ()


@settings(max_examples=200, deadline=None)
@given(ids, ids, ids)
def test_split_around(turn, tail, other):
    around = split_around(turn, turn + tail, "engine")
    assert around == Around(tuple(turn[-16:]), tail, "engine")
    assume(other[: len(turn)] != turn)
    assert split_around(turn, other, "engine") is None


@settings(max_examples=300, deadline=None)
@given(conversations(), st.integers(0, 30))
def test_opening_messages_is_the_encoding_of_the_first_ones(conv, upto):
    messages = conv[0][-1]["messages"]
    encoded = msgspec.json.encode(messages)
    assert opening_messages(encoded, messages, upto) == msgspec.json.encode(messages[:upto])


token_ids = st.lists(st.integers(0, 2**27) | st.sampled_from([0, 1, 10, 100]), max_size=40)


@settings(max_examples=400, deadline=None)
@given(token_ids.filter(bool), token_ids, token_ids, st.booleans())
def test_split_spans_is_split_around_of_the_parsed_renders(turn, tail, other, spaced):
    # As the engine writes them (compact), or with spaces (parsed whole then).
    def dump(ids):
        return json.dumps(ids, separators=(",   ", ":") if spaced else (",", ":")).encode()

    for full in (turn + tail, other, turn[:-1], turn[:-1] + [turn[-1] * 10 + 1]):
        assert split_spans(dump(turn), dump(full), "engine") == split_around(turn, full, "engine")


def test_counts_by_path_and_reason():
    records = [
        {"path": "render", "reason": cont.FIRST_TURN},
        {"path": "exact", "parent": "p"},
        {"path": "exact", "parent": "q"},
        {"path": "fallback", "reason": cont.TURN_END},
        None,
    ]
    assert counts(records) == {
        "exact": 2,
        "render": 1,
        "fallback": 1,
        "reasons": {"fallback: turn end differs": 1, "render: first turn": 1},
    }


def test_render_body_keeps_what_shapes_the_prompt():
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "q"}],
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "run"}},
        "temperature": 1.0,
        "max_tokens": 9,
        "stream": True,
        "continue_final_message": True,
        "add_generation_prompt": False,
    }
    turn = render_body(body, body["messages"], ending="none")
    assert turn == {
        "model": "m",
        "tools": TOOLS,
        "messages": body["messages"],
        "add_generation_prompt": False,
    }
    assert render_body(body, [], ending="request")["continue_final_message"] is True
    assert (
        render_body(body | {"tool_choice": "none"}, [], ending="generation")["tool_choice"]
        == "none"
    )


class _Engine:
    """An engine stand-in that renders every probe like the local template below."""

    async def render(self, upstream, body):
        return [1, 2, 3]

    async def around(self, upstream, body, upto, encoded=None):
        return Around((1,), [2, 3], "engine")


class _Local:
    def __init__(self) -> None:
        self.threads: list[str] = []

    def render(self, body, content_format):
        return [1, 2, 3]

    def around(self, body, upto, content_format):
        self.threads.append(threading.current_thread().name)
        return Around((1,), [2, 3], "local")


async def test_local_renders_run_off_the_event_loop():
    local = _Local()
    renderer = CheckedRenderer(_Engine(), local)
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    answers = [await renderer.around("u", body, 1) for _ in range(3)]
    # The first request of a context is the engine's (and checks the local render).
    assert [a.by for a in answers] == ["engine", "local", "local"]
    assert local.threads and all(t.startswith("rolltap-render") for t in local.threads)
    assert threading.current_thread().name not in local.threads


def test_side_by_side_answers_both_in_order_and_a_failure_cancels_the_other():
    async def go():
        assert await side_by_side(asyncio.sleep(0.01, "turn"), asyncio.sleep(0, "full")) == (
            "turn", "full")
        started, ended = asyncio.Event(), []

        async def slow():
            started.set()
            try:
                await asyncio.sleep(30)
            finally:
                ended.append("cancelled")

        async def fails():
            await started.wait()
            raise RenderError("the engine said no")

        with pytest.raises(RenderError):
            await side_by_side(slow(), fails())
        await asyncio.sleep(0)
        assert ended == ["cancelled"]

    asyncio.run(go())


roles = st.sampled_from(["system", "developer", "user", "assistant", "tool"])


@given(st.lists(roles, min_size=1, max_size=30), st.data())
def test_a_window_keeps_the_reply_what_follows_and_for_frame_the_frame(role_list, data):
    messages = [{"role": r, "content": str(i)} for i, r in enumerate(role_list)]
    upto = data.draw(st.integers(1, len(messages)))
    for kind in WINDOWS:
        kept = window(messages, upto, kind)
        if kept is None:
            continue
        frame = kind == "frame"
        head = 0
        while frame and head < len(role_list) and role_list[head] in ("system", "developer"):
            head += 1
        tail = set(range(max(upto - 1, head), len(messages)))  # the reply and what follows it
        assert kept == sorted(set(kept)) and len(kept) + 1 < len(messages)
        assert tail | set(range(head)) <= set(kept)  # for frame, the system messages too
        users = [i for i in range(head, upto - 1) if role_list[i] == "user"]
        # Of what lies between, only the last user message before the reply, for frame.
        between = set(kept) - set(range(head)) - tail
        assert between == (set(users[-1:]) if kind == "frame" else set())


def test_windows_of_an_agent_conversation():
    messages = [{"role": "system"}, {"role": "user"}]
    messages += [{"role": "assistant"}, {"role": "tool"}] * 50 + [{"role": "user"}]
    assert window(messages, 101, "reply") == [*range(100, 103)]
    assert window(messages, 101, "frame") == [0, 1, *range(100, 103)]
    assert window(messages[:4], 3, "frame") is None  # nothing worth leaving out


async def test_a_crosscheck_learns_per_key_rechecks_samples_and_forgets_the_oldest():
    check = Crosscheck("cheap rendering", "the reference", sample_every=2, keys=2)
    same, other = Around((1,), [2], "cheap"), Around((1,), [3], "reference")
    check.judge("a", same, same)
    check.judge("b", same, other)
    assert (check.trusted("a"), check.trusted("b")) == (True, False)
    check.judge("c", same, same)  # one key too many: "a", the least recently used, goes
    assert (check.trusted("a"), check.trusted("b"), check.trusted("c")) == (None, False, True)

    async def reference():
        return other

    check.used("c", same, reference)  # not sampled
    await asyncio.sleep(0.01)
    assert check.trusted("c") is True
    check.used("c", same, reference)  # the second use is checked again, and disagrees
    await asyncio.sleep(0.01)
    assert check.trusted("c") is False
    assert check.stats == {"used": 2, "checked": 4, "mismatches": 2}


async def test_a_crosscheck_checks_less_often_while_it_agrees_down_to_a_floor():
    check = Crosscheck("cheap rendering", "the reference", sample_every=1)
    same = Around((1,), [2], "cheap")

    async def reference():
        return same

    check.judge("a", same, same)
    sampled = []
    for use in range(1, 32):
        before = check.stats["checked"]
        check.used("a", same, reference)
        await asyncio.sleep(0)  # the sample, if any, answers at once
        await asyncio.sleep(0)
        if check.stats["checked"] > before:
            sampled.append(use)
    # The gaps double while the checks agree, up to 8 uses (8 * sample_every).
    assert sampled == [1, 2, 4, 8, 16, 24]


@given(st.lists(st.tuples(roles, st.booleans()), min_size=1, max_size=8),
       st.lists(st.tuples(roles, st.booleans()), min_size=1, max_size=8))
def test_a_shape_tells_apart_what_windows_depend_on_in_a_few_bytes(a, b):
    def messages(spec):
        return [{"role": r, "content": "x", **({"tool_calls": [{}]} if c else {})} for r, c in spec]

    lead = [{"role": "user", "content": "long ago"}] * 3
    assert (shape(lead + messages(a), 4) == shape(messages(b), 1)) == (a == b)
    assert len(shape(messages(a) * 500, 1)) == 16
