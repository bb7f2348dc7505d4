"""Nothing the gateway records is wrong, and nothing it acknowledges is lost (issue 11).

Against a real Postgres and the real vLLM: a row the database refuses fails only its own call;
the end of a response never reaches the client before its record is committed; a commit that
fails mid-stream ends the stream with the protocol's error event; a call that outlives its
rollout is refused, not dropped; retries are marked; constrained sampling is marked and kept
out of training; a misaligned engine reply (from a fault stand-in) fails only its own call and
never stops merging.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid

import anthropic
import asyncpg
import httpx
import openai
import pytest
from aiohttp import web

from tests.support.gateway import GatewayProcess, free_port
from tests.support.postgres import fresh_database
from tests.support.vllm import PICK_COLOR_TOOL, tool_call_request

# The same tool without `strict`: offered, not forced, so sampling stays free.
FREE_TOOL = {**PICK_COLOR_TOOL, "function": {**PICK_COLOR_TOOL["function"], "strict": False}}

# The end of a response, per protocol: nothing of it may arrive before the commit. (A
# Responses stream cut at max_output_tokens ends in `response.incomplete`.)
ENDS = {"chat": (b"[DONE]",), "completions": (b"[DONE]",),
        "responses": (b"response.completed", b"response.incomplete"),
        "anthropic": (b"message_stop",)}


def ended(protocol: str, data: bytes) -> bool:
    return any(end in data for end in ENDS[protocol])


def run(coro):
    return asyncio.run(coro)


async def _sql(dsn: str, sql: str, *args):
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetch(sql, *args)
    finally:
        await conn.close()


def sql(dsn: str, sql_text: str, *args):
    return run(_sql(dsn, sql_text, *args))


@pytest.fixture(scope="module")
def own_db():
    dsn, drop = fresh_database("rolltap_integrity")
    yield dsn
    drop()


@pytest.fixture(scope="module")
def gw(vllm_server, own_db, tmp_path_factory):
    """A gateway with the default training options on a database of its own; commits may wait
    for a lock the tests hold."""
    g = GatewayProcess([vllm_server.url], own_db, "--db-command-timeout", "30",
                       log_path=tmp_path_factory.mktemp("gw-integrity") / "gateway.log").start()
    yield g
    g.stop()


def request(protocol: str, model: str, text: str, stream: bool, max_tokens: int = 8):
    """(path, body) of a minimal request in `protocol`."""
    if protocol == "chat":
        return "/v1/chat/completions", {"model": model, "stream": stream, "max_tokens": max_tokens,
                                        "messages": [{"role": "user", "content": text}]}
    if protocol == "completions":
        return "/v1/completions", {"model": model, "stream": stream, "max_tokens": max_tokens,
                                   "prompt": text}
    if protocol == "responses":
        return "/v1/responses", {"model": model, "stream": stream, "input": text,
                                 "max_output_tokens": max_tokens}
    return "/v1/messages", {"model": model, "stream": stream, "max_tokens": max_tokens,
                            "messages": [{"role": "user", "content": text}]}


def headers(rollout: dict, **extra) -> dict:
    return {"Authorization": f"Bearer {rollout['api_key']}", **extra}


def _healthz(gw) -> dict:
    return gw.admin.get("/healthz", timeout=5).json()


# -- durability order ---------------------------------------------------------------------------


async def _blocked_lock(dsn: str):
    """A test connection holding a lock every insert into `calls` waits for."""
    conn = await asyncpg.connect(dsn)
    tx = conn.transaction()
    await tx.start()
    await conn.execute("LOCK TABLE calls IN EXCLUSIVE MODE")
    return conn, tx


async def _waiting_inserts(dsn: str) -> int:
    rows = await _sql(dsn, "SELECT count(*) AS n FROM pg_locks WHERE relation = 'calls'::regclass"
                           " AND NOT granted")
    return rows[0]["n"]


def test_no_end_of_response_reaches_the_client_before_its_commit(gw, own_db, vllm_server):
    """Every protocol, streamed or not: while the recorder's insert waits for a lock, the
    client has not received `[DONE]`, `response.completed`, `message_stop` or a JSON body; once
    the lock goes, each gets its end."""
    rollout = gw.new_rollout(task_id="order")
    cases = [(p, s) for p in ENDS for s in (False, True)]

    async def one(client, protocol, stream, received):
        path, body = request(protocol, vllm_server.model, f"order {protocol}", stream)
        async with client.stream("POST", gw.url + path, json=body,
                                 headers=headers(rollout)) as resp:
            received["status"] = resp.status_code
            async for piece in resp.aiter_raw():
                received["bytes"] += piece
        received["done"] = True

    async def scenario():
        conn, tx = await _blocked_lock(own_db)
        received = {case: {"bytes": b"", "done": False, "status": None} for case in cases}
        async with httpx.AsyncClient(timeout=120) as client:
            tasks = [asyncio.create_task(one(client, p, s, received[(p, s)])) for p, s in cases]
            try:
                deadline = time.monotonic() + 90
                # All eight wait for their commit: one batch blocked on the lock, the rest queued.
                while time.monotonic() < deadline:
                    if (await _waiting_inserts(own_db) >= 1
                            and _healthz(gw)["recorder"]["pending"] >= len(cases)):
                        break
                    await asyncio.sleep(0.05)
                else:
                    pytest.fail(f"calls never reached their commit: {_healthz(gw)}")
                await asyncio.sleep(0.5)  # time for any early end to arrive, were there one
                for (protocol, stream), got in received.items():
                    assert not got["done"], (protocol, stream)
                    assert not ended(protocol, got["bytes"]), (protocol, stream)
                    if not stream:  # nothing at all of a whole response before its commit
                        assert got["status"] is None and got["bytes"] == b"", (protocol, stream)
                    else:  # the tokens themselves did stream
                        assert got["status"] == 200 and got["bytes"], (protocol, stream)
            finally:
                await tx.rollback()
                await conn.close()
            await asyncio.gather(*tasks)
        return received

    received = run(scenario())
    for (protocol, stream), got in received.items():
        assert got["status"] == 200, (protocol, stream, got["bytes"][:300])
        if stream:
            assert ended(protocol, got["bytes"]), (protocol, got["bytes"][-300:])
        else:
            assert got["bytes"].rstrip().endswith(b"}")
    assert len(gw.calls(rollout["rollout_id"])) == len(cases)


# -- item 1: one refused row fails only its own call ---------------------------------------------


def test_a_refused_row_fails_only_its_call_and_its_rollout_goes_on(gw, own_db, vllm_server):
    # A fault stand-in in the database: a trigger refusing rows marked by their user agent.
    sql(own_db, """
        CREATE OR REPLACE FUNCTION test_refuse_marked() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF NEW.user_agent = 'refuse-me' THEN
                RAISE EXCEPTION 'fault stand-in: row refused';
            END IF;
            RETURN NEW;
        END $$""")
    sql(own_db, "CREATE TRIGGER test_refuse_marked BEFORE INSERT ON calls FOR EACH ROW"
                " EXECUTE FUNCTION test_refuse_marked()")
    try:
        a, b = gw.new_rollout(task_id="refused-a"), gw.new_rollout(task_id="refused-b")
        refused_body = {"model": vllm_server.model, "max_tokens": 8,
                        "messages": [{"role": "user", "content": "the refused turn"}]}
        retries_before = _healthz(gw)["recorder"]["row_retries"]

        async def post(client, rollout, body, agent="test"):
            return await client.post(gw.url + "/v1/chat/completions", json=body,
                                     headers=headers(rollout, **{"User-Agent": agent}))

        async def scenario():
            conn, tx = await _blocked_lock(own_db)
            async with httpx.AsyncClient(timeout=120) as client:
                first = asyncio.create_task(post(client, b, request(
                    "chat", vllm_server.model, "first", False)[1]))
                while await _waiting_inserts(own_db) < 1:
                    await asyncio.sleep(0.05)
                # These five queue behind the blocked commit and share the next batch.
                rest = [asyncio.create_task(post(client, a, refused_body, "refuse-me"))]
                rest += [asyncio.create_task(post(client, r, request(
                    "chat", vllm_server.model, f"other {i}", False)[1]))
                    for i, r in enumerate((a, a, b, b))]
                while _healthz(gw)["recorder"]["pending"] < len(rest) + 1:
                    await asyncio.sleep(0.05)
                await tx.rollback()
                await conn.close()
                answers = await asyncio.gather(first, *rest)
                # The same request again (now without the fault): under the old code its base
                # was the refused call, which the foreign key rejected.
                again = await post(client, a, refused_body)
            return answers, again

        answers, again = run(scenario())
        refused = answers[1]
        assert refused.status_code == 500
        assert "refused" in refused.json()["error"]["message"]
        assert [r.status_code for r in answers[:1] + answers[2:]] == [200] * 5
        assert again.status_code == 200, again.text
        assert _healthz(gw)["recorder"]["row_retries"] > retries_before
        assert len(gw.calls(a["rollout_id"])) == 3 and len(gw.calls(b["rollout_id"])) == 3
        summary = gw.finish(a["rollout_id"], 1.0).json()
        assert summary["merge_status"] == "merged" and summary["merge"]["stats"]["calls"] == 3
    finally:
        sql(own_db, "DROP TRIGGER test_refuse_marked ON calls")


# -- items 4 and 5: failures after the stream started --------------------------------------------


def _terminate_backends(dsn: str) -> int:
    """Kills every other connection to the test's database and returns once their backends
    have exited. (Without the wait, pg_terminate_backend only signals: on a busy machine the
    gateway's next query, on a pooled connection whose backend has not died yet, then fails
    with the termination itself instead of finding the connection closed and reconnecting.)"""
    rows = sql(dsn, "SELECT pg_terminate_backend(pid, 10000) AS ok FROM pg_stat_activity"
                    " WHERE datname = current_database() AND pid <> pg_backend_pid()")
    return len(rows)


def _wait_healthy(gw, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if httpx.get(gw.url + "/healthz", timeout=5).status_code == 200:
            return
        time.sleep(0.1)
    raise AssertionError(f"gateway not healthy again: {_healthz(gw)}")


def _writer_connected(gw, model: str) -> None:
    """One committed call, so the recorder holds its connection (it keeps one open)."""
    scratch = gw.new_rollout(task_id="scratch")
    r = httpx.post(scratch["openai_base_url"] + "/chat/completions", headers=headers(scratch),
                   json=request("chat", model, "scratch", False, 2)[1], timeout=120)
    assert r.status_code == 200, r.text


def test_commit_lost_mid_stream_gives_the_sdk_a_protocol_error(gw, own_db, vllm_server):
    _writer_connected(gw, vllm_server.model)
    rollout = gw.new_rollout(task_id="terminated")
    client = openai.OpenAI(base_url=rollout["openai_base_url"], api_key=rollout["api_key"],
                           max_retries=0, timeout=120)
    # The recorder's connection dies before the call; it finds out only at its commit, after
    # the tokens streamed. (Killing it at the first chunk races a fast engine that has sent
    # everything, committed included, before the client reads its first chunk.)
    assert _terminate_backends(own_db) >= 1
    stream = client.chat.completions.create(
        model=vllm_server.model, stream=True, max_tokens=16,
        messages=[{"role": "user", "content": "terminated"}])
    with pytest.raises(openai.APIError) as caught:
        for _chunk in stream:
            pass
    assert "will be written when the database answers again" in str(caught.value)
    assert not isinstance(caught.value, openai.APIConnectionError)  # a clean chunked body
    _wait_healthy(gw)

    ant = anthropic.Anthropic(base_url=rollout["anthropic_base_url"], api_key=rollout["api_key"],
                              max_retries=0, timeout=120)
    _writer_connected(gw, vllm_server.model)
    _terminate_backends(own_db)
    with pytest.raises(anthropic.APIStatusError) as caught_ant:
        with ant.messages.stream(model=vllm_server.model, max_tokens=16,
                                 messages=[{"role": "user", "content": "terminated"}]) as s:
            for _event in s:
                pass
    assert "will be written when the database answers again" in str(caught_ant.value)
    _wait_healthy(gw)
    # Neither is lost: the recorder held both records and writes them once the database
    # answers; the rollout goes on.
    deadline = time.monotonic() + 30
    while len(gw.calls(rollout["rollout_id"])) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    client.chat.completions.create(model=vllm_server.model, max_tokens=4,
                                   messages=[{"role": "user", "content": "after"}])
    calls = gw.calls(rollout["rollout_id"])
    assert [c["protocol"] for c in calls] == ["chat", "anthropic", "chat"]
    assert [c["status"] for c in calls] == ["ok"] * 3


def test_a_call_ending_after_finish_is_refused_not_dropped(gw, own_db, vllm_server):
    """A finish lands while a call streams: the test runs the finish's own UPDATE in a
    transaction it holds open, so the call's insert waits on the rollout's row, then commits
    it. The call ends after the finish and must be refused, not kept out of the traces unseen;
    the finish through the admin API then merges the rollout."""
    rollout = gw.new_rollout(task_id="late")
    early = request("chat", vllm_server.model, "early", False)[1]
    assert httpx.post(gw.url + "/v1/chat/completions", json=early, headers=headers(rollout),
                      timeout=120).status_code == 200

    async def scenario():
        conn = await asyncpg.connect(own_db)
        tx = conn.transaction()
        await tx.start()
        await conn.execute("UPDATE rollouts SET status = 'finished', reward = 0.5,"
                           " finished_at = now() WHERE id = $1", uuid.UUID(rollout["rollout_id"]))
        async with httpx.AsyncClient(timeout=120) as client:
            path, body = request("chat", vllm_server.model, "late", True)
            late = asyncio.create_task(client.post(gw.url + path, json=body,
                                                   headers=headers(rollout)))
            while not await conn.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                    " AND datname = current_database()"):
                await asyncio.sleep(0.05)
            await tx.commit()
            await conn.close()
            return await late

    late = run(scenario())
    assert late.status_code == 200  # the stream had started: the error is its last event
    assert b"[DONE]" not in late.content and b"rollout has ended" in late.content
    assert b"rollout_ended" in late.content
    assert gw.finish(rollout["rollout_id"], 0.5).status_code == 200
    summary = gw.admin.get(f"/admin/rollouts/{rollout['rollout_id']}").json()
    # The client was told; the merged traces hold exactly the calls that were recorded.
    assert summary["merge_status"] == "merged"
    assert summary["merge"]["stats"]["calls"] == len(summary["calls"]) == 1


# -- item 6: retries -----------------------------------------------------------------------------


def test_sdk_retry_header_and_repeated_body_mark_the_first_attempt_abandoned(gw, vllm_server):
    rollout = gw.new_rollout(task_id="retries")
    client = openai.OpenAI(base_url=rollout["openai_base_url"], api_key=rollout["api_key"],
                           max_retries=0, timeout=120)
    client.chat.completions.create(model=vllm_server.model, max_tokens=4,
                                   messages=[{"role": "user", "content": "first attempt"}])
    client.chat.completions.create(model=vllm_server.model, max_tokens=4,
                                   messages=[{"role": "user", "content": "changed body"}],
                                   extra_headers={"x-stainless-retry-count": "1"})
    ant = anthropic.Anthropic(base_url=rollout["anthropic_base_url"], api_key=rollout["api_key"],
                              max_retries=0, timeout=120)
    for _ in range(2):  # the same body twice, no header: a retry after a timeout
        ant.messages.create(model=vllm_server.model, max_tokens=4,
                            messages=[{"role": "user", "content": "same body"}])
    summary = gw.finish(rollout["rollout_id"], 1.0).json()
    calls = summary["calls"]
    assert [c["retry_count"] for c in calls] == [0, 1, 0, 0]
    assert [c["abandoned"] for c in calls] == [True, False, True, False]
    assert summary["merge"]["stats"]["retried_calls"] == 2


# -- item 3: constrained sampling ----------------------------------------------------------------


def test_strict_tool_call_is_recorded_constrained_and_not_trained(gw, vllm_server):
    rollout = gw.new_rollout(task_id="constrained")
    client = openai.OpenAI(base_url=rollout["openai_base_url"], api_key=rollout["api_key"],
                           max_retries=0, timeout=120)
    body = tool_call_request([{"role": "user", "content": "pick"}])
    forced = client.chat.completions.create(**body)
    assert forced.choices[0].message.tool_calls
    free = client.chat.completions.create(
        model=vllm_server.model, max_tokens=8, tools=[FREE_TOOL],
        messages=[{"role": "user", "content": "free"}])
    assert free.choices
    calls = gw.calls(rollout["rollout_id"])
    assert [c["constrained"] for c in calls] == [True, False]
    assert set(calls[0]["applied"]["constrained_by"]) == {"tool_choice", "tools.strict"}
    summary = gw.finish(rollout["rollout_id"], 1.0).json()
    stats = summary["merge"]["stats"]
    assert stats["constrained_calls"] == 1
    assert stats["constrained_tokens"] == len(calls[0]["completion_ids"])
    traces = gw.admin.get(f"/admin/rollouts/{rollout['rollout_id']}/traces").json()["sequences"]
    forced_seq = next(t for t in traces if t["call_ids"][-1] == calls[0]["call_id"])
    assert sum(forced_seq["loss_mask"]) == 0
    assert stats["trained_tokens"] == len(calls[1]["completion_ids"])
    metrics = gw.admin.get("/admin/metrics").json()["harnesses"]
    assert sum(h["constrained_calls"] for h in metrics) >= 1


def test_fields_that_change_sampling_never_reach_the_engine(gw, vllm_server):
    """Issue #28, attack 8: an allow-list, not a deny-list. Beam search, length penalty, custom
    logits-processor arguments, watermarking and the engine's own prompt-ids channel are
    stripped and named in the record; the call trains as a free one, on the prompt the gateway
    rendered (with `kv_transfer_params` the engine would have taken three made-up ids)."""
    rollout = gw.new_rollout(task_id="allow-list")
    client = openai.OpenAI(base_url=rollout["openai_base_url"], api_key=rollout["api_key"],
                           max_retries=0, timeout=120)
    reply = client.chat.completions.create(
        model=vllm_server.model, max_tokens=6, messages=[{"role": "user", "content": "hello"}],
        extra_body={"use_beam_search": True, "length_penalty": 2.0, "watermarking": {"on": 1},
                    "vllm_xargs": {"x": 1}, "kv_transfer_params": {"prompt_token_ids": [1, 2, 3]},
                    "no_such_field": 1, "min_tokens": 2, "stop": ["zzz"]})
    assert reply.choices
    [call] = gw.calls(rollout["rollout_id"])
    assert call["applied"]["stripped"] == ["kv_transfer_params", "length_penalty", "no_such_field",
                                           "use_beam_search", "vllm_xargs", "watermarking"]
    assert call["applied"]["constrained_by"] == ["min_tokens"] and call["constrained"]
    assert len(call["prompt_ids"]) > 3


# -- item 7: NUL in the harness's own output -----------------------------------------------------


def test_finish_with_nul_in_metrics_succeeds_and_records_the_cleaning(gw):
    rollout = gw.new_rollout(task_id="nul-metrics")
    r = gw.finish(rollout["rollout_id"], 0.0,
                  metrics={"stderr_tail": "codex printed \u0000 here", "exit": 0})
    assert r.status_code == 200, r.text
    metrics = r.json()["metrics"]
    assert metrics["stderr_tail"] == "codex printed \ufffd here"
    assert metrics["rolltap_escaped"] == 1


# -- item 2: a misaligned engine reply -----------------------------------------------------------


class MisalignedEngine:
    """Fault stand-in for vLLM: forwards everything to the real engine, but drops the last
    logprob of any chat completion whose request mentions `MISALIGN`."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    async def _forward(self, request: web.Request) -> web.Response:
        raw = await request.read()
        async with self._session.request(request.method, self.upstream + request.path_qs,
                                         data=raw or None,
                                         headers={"Content-Type": "application/json"}) as resp:
            body = await resp.read()
            if resp.status == 200 and b"MISALIGN" in raw and request.path.endswith("/completions"):
                payload = json.loads(body)
                payload["choices"][0]["logprobs"]["content"].pop()
                body = json.dumps(payload).encode()
            return web.Response(status=resp.status, body=body,
                                content_type=resp.content_type or "application/json")

    def _run(self) -> None:
        import aiohttp

        asyncio.set_event_loop(self._loop)

        async def start():
            self._session = aiohttp.ClientSession()
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", self._forward)
            self._runner = web.AppRunner(app)
            await self._runner.setup()
            await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
            self._started.set()

        self._loop.run_until_complete(start())
        self._loop.run_forever()

    def __enter__(self):
        self._thread.start()
        assert self._started.wait(30)
        return self

    def __exit__(self, *exc):
        async def stop():
            await self._session.close()
            await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)


def test_misaligned_reply_fails_only_its_call_and_merging_goes_on(vllm_server, own_db, tmp_path):
    with MisalignedEngine(vllm_server.url) as engine:
        g = GatewayProcess([engine.url], own_db, log_path=tmp_path / "gw.log").start()
        try:
            def play(rollout):
                client = openai.OpenAI(base_url=rollout["openai_base_url"],
                                       api_key=rollout["api_key"], max_retries=0, timeout=120)
                ok = client.chat.completions.create(
                    model=vllm_server.model, max_tokens=8, tools=[FREE_TOOL],
                    messages=[{"role": "user", "content": "fine"}])
                with pytest.raises(openai.APIStatusError) as caught:
                    client.chat.completions.create(
                        model=vllm_server.model, max_tokens=8,
                        messages=[{"role": "user", "content": "MISALIGN me"}])
                assert caught.value.status_code == 502
                assert "logprobs" in caught.value.message
                return ok

            finished = g.new_rollout(task_id="misaligned-finish")
            play(finished)
            summary = g.finish(finished["rollout_id"], 1.0).json()
            assert summary["merge_status"] == "merged"
            stats = summary["merge"]["stats"]
            assert stats["calls"] == 2 and stats["context_only_calls"] == 1
            assert stats["trained_tokens"] > 0
            # At the deadline: the sweeper merges it, and goes on to merge the next one.
            overdue = []
            for i in range(2):
                overdue.append(g.new_rollout(task_id=f"misaligned-deadline-{i}", timeout_s=3))
                play(overdue[-1])
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                states = [g.admin.get(f"/admin/rollouts/{r['rollout_id']}").json()
                          for r in overdue]
                if all(s["merge_status"] == "merged" for s in states):
                    break
                time.sleep(0.5)
            assert [(s["status"], s["merge_status"]) for s in states] == [("timeout", "merged")] * 2
            assert all(s["merge"]["stats"]["context_only_calls"] == 1 for s in states)
        finally:
            g.stop()


# -- a bounded record queue ----------------------------------------------------------------------


def test_new_calls_are_turned_away_while_records_wait(vllm_server, own_db, tmp_path):
    """When Postgres falls behind, new calls get 503 (OpenAI) or 529 (Anthropic) with
    Retry-After instead of queueing without bound; the waiting call still commits."""
    g = GatewayProcess([vllm_server.url], own_db, "--max-pending-records", "1",
                       "--db-command-timeout", "30", log_path=tmp_path / "gw.log").start()
    try:
        rollout = g.new_rollout(task_id="backlog")

        async def scenario():
            conn, tx = await _blocked_lock(own_db)
            async with httpx.AsyncClient(timeout=120) as client:
                path, body = request("chat", vllm_server.model, "waits", False)
                waiting = asyncio.create_task(
                    client.post(g.url + path, json=body, headers=headers(rollout)))
                while await _waiting_inserts(own_db) < 1:
                    await asyncio.sleep(0.05)
                turned = {}
                for protocol in ("chat", "anthropic"):
                    path, body = request(protocol, vllm_server.model, "turned away", False)
                    turned[protocol] = await client.post(g.url + path, json=body,
                                                         headers=headers(rollout))
                await tx.rollback()
                await conn.close()
                return await waiting, turned

        waiting, turned = run(scenario())
        assert waiting.status_code == 200
        openai_answer, anthropic_answer = turned["chat"], turned["anthropic"]
        assert openai_answer.status_code == 503 and openai_answer.headers["Retry-After"]
        assert openai_answer.json()["error"]["type"] == "overloaded_error"
        assert anthropic_answer.status_code == 529 and anthropic_answer.headers["Retry-After"]
        assert anthropic_answer.json()["error"]["type"] == "overloaded_error"
        assert len(g.calls(rollout["rollout_id"])) == 1
    finally:
        g.stop()
