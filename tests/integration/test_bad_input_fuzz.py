"""Bad input is answered in the caller's protocol and never reaches Postgres unchecked (issue
11, item 7): a hypothesis fuzz over the four model protocols and the admin routes, against the
real gateway, vLLM and Postgres. Any answer is a success or a 4xx in the protocol's own error
shape, never a 5xx, and the rows recorded before stay exactly as they were."""

from __future__ import annotations

import asyncio
import json
import math

import asyncpg
import httpx
import msgspec
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.support.gateway import GatewayProcess
from tests.support.postgres import fresh_database

NUL = "\u0000"

# Values no field may hold once stored: NUL in strings, integers beyond 64 bits, numbers
# beyond a double, nesting deeper than anything real, and plain wrong types.
BAD_VALUES = st.one_of(
    st.text(max_size=8).map(lambda t: t + NUL + t),
    st.integers(min_value=2**63, max_value=2**200),
    st.integers(max_value=-(2**63) - 1, min_value=-(2**200)),
    st.sampled_from([1e308, -1e308, 1.7976931348623157e308]),
    st.integers(min_value=100, max_value=20_000).map(lambda d: {"deep": d}),  # built as raw JSON
    st.sampled_from([True, False, None, [], {}, "x", 0, -1, 1.5]),
    st.dictionaries(st.text(max_size=4).map(lambda k: k + NUL), st.integers(), min_size=1,
                    max_size=2),
)


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


def _encode(body: dict) -> bytes:
    """JSON of `body`, with {"deep": d} markers written as `d` nested lists (msgspec would
    refuse to encode them) and numbers beyond a double written out literally."""
    raw = msgspec.json.encode(_mark(body)).decode()
    for marker, text in _LITERALS.items():
        raw = raw.replace(f'"{marker}"', text)
    _LITERALS.clear()
    return raw.encode()


_LITERALS: dict[str, str] = {}


def _mark(value):
    if isinstance(value, dict):
        if set(value) == {"deep"} and isinstance(value["deep"], int):
            marker = f"@deep{len(_LITERALS)}@"
            _LITERALS[marker] = _deep(value["deep"])
            return marker
        return {k: _mark(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_mark(v) for v in value]
    if (isinstance(value, float) and not math.isfinite(value)) or (
            isinstance(value, int) and not -(2**63) <= value < 2**64):
        marker = f"@num{len(_LITERALS)}@"
        _LITERALS[marker] = "1e999" if isinstance(value, float) else str(value)
        return marker
    return value


def _bases(model: str) -> dict[str, tuple[str, dict]]:
    user = [{"role": "user", "content": "hi"}]
    return {
        "chat": ("/v1/chat/completions", {"model": model, "max_tokens": 1, "messages": user}),
        "completions": ("/v1/completions", {"model": model, "max_tokens": 1, "prompt": "hi"}),
        "responses": ("/v1/responses", {"model": model, "max_output_tokens": 1, "input": "hi"}),
        "anthropic": ("/v1/messages", {"model": model, "max_tokens": 1, "messages": user}),
    }


# Where bad values go: fields every protocol reads, sampling fields the gateway records, the
# stateful protocol's id, metadata, and the places of the 500s.
FIELDS = {
    "chat": ["seed", "temperature", "top_p", "logit_bias", "n", "max_tokens", "stop", "user",
             "metadata", "tools", "tool_choice", "messages", "model", "stream",
             "messages.0", "messages.0.content", "messages.0.role"],
    "completions": ["seed", "temperature", "n", "max_tokens", "prompt", "logprobs", "model",
                    "stream", "stop"],
    "responses": ["temperature", "top_p", "metadata", "previous_response_id", "input",
                  "instructions", "tools", "tool_choice", "max_output_tokens", "model", "text",
                  "reasoning", "stream"],
    "anthropic": ["temperature", "top_p", "top_k", "metadata", "system", "messages", "tools",
                  "tool_choice", "max_tokens", "model", "stop_sequences", "stream",
                  "messages.0.content", "thinking"],
}


def _set(body: dict, path: str, value) -> dict:
    out = msgspec.json.decode(msgspec.json.encode(body))
    keys = path.split(".")
    node = out
    for k in keys[:-1]:
        node = node[int(k)] if k.isdigit() else node[k]
    last = keys[-1]
    if last.isdigit():
        node[int(last)] = value
    else:
        node[last] = value
    return out


def _openai_shaped(r: httpx.Response) -> bool:
    err = r.json().get("error")
    return isinstance(err, dict) and isinstance(err.get("message"), str) and "type" in err


def _anthropic_shaped(r: httpx.Response) -> bool:
    body = r.json()
    return body.get("type") == "error" and isinstance(body.get("error", {}).get("message"), str)


async def _snapshot(dsn: str):
    conn = await asyncpg.connect(dsn)
    try:
        calls = await conn.fetch(
            "SELECT id, seq, status, md5(prompt_delta) AS p, md5(completion_ids) AS c,"
            " md5(logprobs) AS l, requested::text AS r, error FROM calls ORDER BY id")
        rollouts = await conn.fetch(
            "SELECT id, status, reward, metrics::text AS m, metadata::text AS md, task_id,"
            " call_count FROM rollouts ORDER BY id")
        policy = await conn.fetchval("SELECT version FROM policy")
        return [tuple(r) for r in calls], [tuple(r) for r in rollouts], policy
    finally:
        await conn.close()


@pytest.fixture(scope="module")
def fuzz_gw(vllm_server, tmp_path_factory):
    dsn, drop = fresh_database("rolltap_fuzz")
    # A rollout's rate limit is not what is fuzzed: a fast machine sends one rollout's cases
    # faster than the default 50 a second, and its answer (429, 529) is right but not this.
    g = GatewayProcess([vllm_server.url], dsn, "--rollout-max-rps", "100000",
                       log_path=tmp_path_factory.mktemp("gw-fuzz") / "gateway.log").start()
    yield g, dsn
    g.stop()
    drop()


def _check_answer(r: httpx.Response, protocol: str) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 400:
        shaped = _anthropic_shaped if protocol == "anthropic" else _openai_shaped
        assert shaped(r), r.text[:500]


@pytest.mark.parametrize("protocol", ["chat", "completions", "responses", "anthropic"])
def test_fuzzed_model_requests_get_4xx_in_protocol_shape(fuzz_gw, vllm_server, protocol):
    gw, dsn = fuzz_gw
    rollout = gw.new_rollout(task_id=f"fuzz-{protocol}")
    path, base = _bases(vllm_server.model)[protocol]
    auth = {"Authorization": f"Bearer {rollout['api_key']}", "Content-Type": "application/json"}
    client = httpx.Client(base_url=gw.url, timeout=60)
    assert client.post(path, json=base, headers=auth).status_code == 200
    before_calls, _, _ = asyncio.run(_snapshot(dsn))

    @settings(max_examples=60, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture,
                                     HealthCheck.too_slow])
    @given(field=st.sampled_from(FIELDS[protocol]), value=BAD_VALUES)
    def one(field, value):
        r = client.post(path, content=_encode(_set(base, field, value)), headers=auth)
        _check_answer(r, protocol)

    one()
    after_calls, _, _ = asyncio.run(_snapshot(dsn))
    # Recorded rows are untouched (requests the engine answered or refused add their own).
    assert set(before_calls) <= set(after_calls)
    client.close()


def test_fuzzed_admin_requests_get_4xx_and_change_nothing(fuzz_gw):
    gw, dsn = fuzz_gw
    target = gw.new_rollout(task_id="fuzz-admin")
    before = asyncio.run(_snapshot(dsn))
    routes = {
        "/admin/rollouts": {"task_id": "t", "group_id": "g", "metadata": {"k": "v"},
                            "timeout_s": 60},
        f"/admin/rollouts/{target['rollout_id']}/finish": {"reward": 1.0, "status": "finished"},
        "/admin/policy": {"version": 1},
    }
    fields = {
        "/admin/rollouts": ["task_id", "group_id", "metadata", "timeout_s"],
        f"/admin/rollouts/{target['rollout_id']}/finish": ["reward", "status"],
        "/admin/policy": ["version"],
    }

    @settings(max_examples=120, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(route=st.sampled_from(sorted(routes)), data=st.data())
    def one(route, data):
        field = data.draw(st.sampled_from(fields[route]))
        value = data.draw(BAD_VALUES)
        body = _set(routes[route], field, value)
        if route.endswith("/finish"):
            # The other field invalid, so the finish is refused whatever the drawn value.
            body["reward" if field == "status" else "status"] = "invalid"
        if route == "/admin/rollouts" and _acceptable_new_rollout(field, value):
            body["timeout_s"] = -1  # keep every generated creation invalid
        if route == "/admin/policy" and value in (0, False):  # a valid version (0) otherwise
            body["version"] = -1
        r = gw.admin.post(route, content=_encode(body),
                          headers={"Content-Type": "application/json"})
        assert 400 <= r.status_code < 500, (route, field, r.status_code, r.text[:300])
        assert _openai_shaped(r), r.text[:300]

    one()
    assert asyncio.run(_snapshot(dsn)) == before


def _acceptable_new_rollout(field: str, value) -> bool:
    """Wrong-typed values some fields take (null task_id, a dict of metadata...)."""
    if field in ("task_id", "group_id"):
        return value is None or (isinstance(value, str) and NUL not in value)
    if field == "timeout_s":
        return value is None or (
            type(value) in (int, float) and 0 < value <= 3.2e9)
    if field == "metadata":
        return isinstance(value, dict) and "deep" not in value and not any(
            NUL in k for k in value)
    return False


# The measured 500s, each by name.
KNOWN = [
    ("chat", "NUL in seed", {"seed": NUL}),
    ("chat", "NUL in a sampling field", {"top_p": "0.5" + NUL}),
    ("chat", "tool call whose function is a string",
     {"messages": [{"role": "user", "content": "x"},
                   {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                         "function": "run"}]},
                   {"role": "tool", "tool_call_id": "c", "content": "ok"},
                   {"role": "user", "content": "y"}]}),
    ("chat", "n: true", {"n": True}),
    ("chat", "JSON nested 10k deep", {"messages": {"deep": 10_000}}),
    ("responses", "NUL in previous_response_id", {"previous_response_id": "resp_" + NUL}),
    ("anthropic", "JSON nested 10k deep", {"metadata": {"deep": 10_000}}),
]


@pytest.mark.parametrize("protocol,name,change", KNOWN, ids=[f"{k[0]}: {k[1]}" for k in KNOWN])
def test_known_bad_requests_get_400(fuzz_gw, vllm_server, protocol, name, change):
    gw, _ = fuzz_gw
    rollout = gw.new_rollout(task_id="known-bad")
    path, base = _bases(vllm_server.model)[protocol]
    r = httpx.post(gw.url + path, content=_encode(base | change), timeout=60,
                   headers={"Authorization": f"Bearer {rollout['api_key']}",
                            "Content-Type": "application/json"})
    assert r.status_code == 400, r.text[:300]
    _check_answer(r, protocol)


@pytest.mark.parametrize("route,body", [
    ("/admin/rollouts", {"task_id": "t" + NUL}),
    ("/admin/rollouts", {"metadata": {"note": NUL}}),
    ("/admin/rollouts", {"timeout_s": 1e308}),
    ("/admin/rollouts", {"timeout_s": 2**70}),
    ("/admin/policy", {"version": -1}),
    ("/admin/policy", {"version": 2**63}),
], ids=["NUL task_id", "NUL metadata", "timeout 1e308", "timeout beyond int64",
        "negative version", "version beyond int64"])
def test_known_bad_admin_requests_get_400(fuzz_gw, route, body):
    gw, dsn = fuzz_gw
    before = asyncio.run(_snapshot(dsn))
    r = gw.admin.post(route, content=_encode(body), headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and _openai_shaped(r), r.text[:300]
    assert asyncio.run(_snapshot(dsn)) == before


# -- arbitrary JSON (issue 39): whatever a body holds, a 4xx or a recorded call -----------------
#
# Bodies are written as JSON text directly, so they may hold what no encoder would write: NUL and
# lone surrogates escaped in keys and strings, numbers beyond a double or 64 bits, nesting
# thousands deep, and values of any type anywhere.

SURROGATE = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
TEXT = st.one_of(st.text(max_size=8), st.text(max_size=3).map(lambda t: t + NUL + t),
                 st.text(SURROGATE, min_size=1, max_size=2), st.text(st.characters(), max_size=4))
KEY_TEXT = st.one_of(st.text(max_size=8), st.text(max_size=3).map(lambda t: NUL + t),
                     st.text(SURROGATE, min_size=1, max_size=2))
RAW_SCALAR = st.one_of(
    TEXT.map(json.dumps),  # json.dumps escapes NUL and lone surrogates as \uXXXX
    st.integers(-(2**200), 2**200).map(str),
    st.floats(allow_nan=False, allow_infinity=False).map(json.dumps),
    st.sampled_from(["1e999", "-1e999", "1e-999", "true", "false", "null", "0", "-0"]),
    st.integers(60, 3_000).map(_deep),
)
RAW = st.recursive(
    RAW_SCALAR,
    lambda inner: st.lists(inner, max_size=3).map(lambda xs: "[" + ",".join(xs) + "]")
    | st.lists(st.tuples(KEY_TEXT.map(json.dumps), inner), max_size=3).map(
        lambda kv: "{" + ",".join(f"{k}:{v}" for k, v in kv) + "}"),
    max_leaves=10,
)


def _raw_body(base: dict, extra: list[tuple[str, str]], field: str | None, value: str) -> bytes:
    """`base` with the raw JSON `value` at `field` and the raw `extra` fields added."""
    marker = "@raw@"
    body = _set(base, field, marker) if field else base
    text = msgspec.json.encode(body).decode().replace(f'"{marker}"', value)
    pairs = "".join(f",{json.dumps(k)}:{v}" for k, v in extra)
    return (text[:-1] + pairs + "}").encode()


def _raw_request(protocol: str):
    return st.one_of(
        st.tuples(st.lists(st.tuples(KEY_TEXT, RAW), min_size=1, max_size=3),
                  st.none(), st.just("")),
        st.tuples(st.lists(st.tuples(KEY_TEXT, RAW), max_size=2),
                  st.sampled_from(FIELDS[protocol]), RAW),
        st.tuples(st.just([]), st.just("*"), RAW),  # the whole body
    )


async def _call_count(dsn: str, rollout_id: str) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetchval("SELECT call_count FROM rollouts WHERE id = $1::uuid",
                                   rollout_id)
    finally:
        await conn.close()


@pytest.mark.parametrize("protocol", ["chat", "completions", "responses", "anthropic"])
def test_arbitrary_json_is_a_4xx_or_a_recorded_call(fuzz_gw, vllm_server, protocol):
    gw, dsn = fuzz_gw
    rollout = gw.new_rollout(task_id=f"arbitrary-{protocol}", timeout_s=3600)
    path, base = _bases(vllm_server.model)[protocol]
    auth = {"Authorization": f"Bearer {rollout['api_key']}", "Content-Type": "application/json"}
    client = httpx.Client(base_url=gw.url, timeout=120)

    @settings(max_examples=400, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture,
                                     HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(request=_raw_request(protocol))
    def one(request):
        extra, field, value = request
        raw = value.encode() if field == "*" else _raw_body(base, extra, field, value)
        before = asyncio.run(_call_count(dsn, rollout["rollout_id"]))
        r = client.post(path, content=raw, headers=auth)
        _check_answer(r, protocol)
        event(f"HTTP {r.status_code}")  # --hypothesis-show-statistics: how many were recorded
        if r.status_code < 300:
            # Answered, so recorded: a stream's failure to record would show here, not in its
            # status line.
            assert asyncio.run(_call_count(dsn, rollout["rollout_id"])) == before + 1, r.text[:300]

    one()
    client.close()


def test_a_nul_in_an_extra_field_is_recorded_escaped(fuzz_gw, vllm_server):
    """The issue's 500s: the stripped field's name holds a NUL; the call is recorded with the
    name escaped, and the record says which columns were."""
    gw, _ = fuzz_gw
    rollout = gw.new_rollout(task_id="escaped")
    path, base = _bases(vllm_server.model)["chat"]
    r = httpx.post(gw.url + path, content=_raw_body(base, [("x" + NUL, '"v' + '\\u0000"')], None,
                                                    ""), timeout=60,
                   headers={"Authorization": f"Bearer {rollout['api_key']}",
                            "Content-Type": "application/json"})
    assert r.status_code == 200, r.text[:300]
    [call] = gw.calls(rollout["rollout_id"])
    assert call["applied"]["stripped"] == ["x\ufffd"]
    assert call["applied"]["escaped"] == ["applied"]


@pytest.fixture(scope="module")
def admin_fuzz_gw(vllm_server, tmp_path_factory):
    """A gateway of its own: the fuzz may add, drain and remove replicas."""
    dsn, drop = fresh_database("rolltap_admin_fuzz")
    g = GatewayProcess([vllm_server.url], dsn, log_path=tmp_path_factory.mktemp("gw-admin-fuzz")
                       / "gateway.log").start()
    yield g
    g.stop()
    drop()


def test_arbitrary_json_to_the_admin_api_is_never_a_5xx(admin_fuzz_gw):
    gw = admin_fuzz_gw
    rollout_ids = [gw.new_rollout(task_id="admin-target")["rollout_id"] for _ in range(3)]
    routes = ["/admin/rollouts", "/admin/policy", "/admin/upstreams",
              "/admin/upstreams/pause-lease",
              *(f"/admin/rollouts/{rid}/finish" for rid in rollout_ids)]
    fields = ["task_id", "group_id", "metadata", "timeout_s", "side_calls", "reward", "status",
              "metrics", "version", "url", "draining", "seconds"]

    @settings(max_examples=400, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture,
                                     HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(route=st.sampled_from(routes),
           body=st.one_of(RAW, st.lists(st.tuples(st.sampled_from(fields) | KEY_TEXT, RAW),
                                        max_size=4).map(
               lambda kv: "{" + ",".join(f"{json.dumps(k)}:{v}" for k, v in kv) + "}")))
    def one(route, body):
        r = gw.admin.post(route, content=body.encode(),
                          headers={"Content-Type": "application/json"})
        assert r.status_code < 500, (route, body[:200], r.status_code, r.text[:300])
        if r.status_code >= 400:
            assert _openai_shaped(r), r.text[:300]

    one()
