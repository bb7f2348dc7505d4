"""Bad input is answered in the caller's protocol and never reaches Postgres unchecked (issue
11, item 7): a hypothesis fuzz over the four model protocols and the admin routes, against the
real gateway, vLLM and Postgres. Any answer is a success or a 4xx in the protocol's own error
shape, never a 5xx, and the rows recorded before stay exactly as they were."""

from __future__ import annotations

import asyncio
import math

import asyncpg
import httpx
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
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
    g = GatewayProcess([vllm_server.url], dsn, log_path=tmp_path_factory.mktemp("gw-fuzz")
                       / "gateway.log").start()
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
        f"/admin/rollouts/{target['rollout_id']}/finish": {"reward": 1.0, "status": "finished",
                                                            "metrics": {"m": {"deep": 70}}},
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
        if route.endswith("/finish") and field != "metrics":
            body["metrics"] = {"m": {"deep": 70}}  # too deep to store: the finish is refused
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
