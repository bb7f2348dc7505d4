"""A kept-alive connection to the engine that closes under a request: the race between reusing
an idle connection and the engine's own idle timeout (vLLM closes one after 5 s). The engine is
the real vLLM; between it and the gateway sits a FAULT STAND-IN, a TCP relay that closes the
connection of chosen model requests once it has read their head, before the engine sees them.
The fault itself is under test: a real engine cannot be made to lose that race on demand."""

from __future__ import annotations

import asyncio
import threading

import openai
import pytest

from tests.support.gateway import GatewayProcess, free_port


class DroppingRelay:
    """Relays every connection to `target`; the next `drop` model requests lose theirs."""

    def __init__(self, target_port: int) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.drop = 0
        self.dropped = 0
        self._target = target_port
        self._loop = asyncio.new_event_loop()
        started = threading.Event()
        threading.Thread(target=self._serve, args=(started,), daemon=True).start()
        assert started.wait(10)

    async def _pipe(self, reader, writer, requests: bool = False) -> None:
        """Copies until EOF; on the `requests` side, a model request to drop ends both ways."""
        try:
            while data := await reader.read(65536):
                if requests and self.drop and data.startswith(b"POST /v1/"):
                    self.drop -= 1
                    self.dropped += 1
                    return  # closed with the head read, as an engine's idle timeout would
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def _client(self, reader, writer) -> None:
        engine_reader, engine_writer = await asyncio.open_connection("127.0.0.1", self._target)
        answers = asyncio.ensure_future(self._pipe(engine_reader, writer))
        try:
            await self._pipe(reader, engine_writer, requests=True)
        finally:
            answers.cancel()
            writer.close()

    def _serve(self, started: threading.Event) -> None:
        async def main():
            await asyncio.start_server(self._client, "127.0.0.1", self.port)
            started.set()
            await asyncio.Event().wait()

        self._loop.run_until_complete(main())


@pytest.fixture
def relayed(vllm_server, database_url, tmp_path):
    relay = DroppingRelay(int(vllm_server.url.rsplit(":", 1)[1]))
    gw = GatewayProcess([relay.url], database_url, log_path=tmp_path / "gw.log").start()
    try:
        yield relay, gw, vllm_server.model
    finally:
        gw.stop()


def _replica(gw: GatewayProcess) -> dict:
    [replica] = gw.admin.get("/admin/upstreams").json()["upstreams"]
    return replica


@pytest.mark.parametrize("stream", [False, True])
def test_a_connection_closed_under_a_request_is_asked_again(relayed, stream):
    relay, gw, model = relayed
    rollout = gw.new_rollout()
    client = openai.OpenAI(base_url=rollout["openai_base_url"], api_key=rollout["api_key"],
                           max_retries=0, timeout=120)
    relay.drop = 1
    answer = client.chat.completions.create(
        model=model, max_tokens=8, stream=stream,
        messages=[{"role": "user", "content": "are you there?"}])
    if stream:
        assert [c for c in answer]  # the stream ran to its end
    assert relay.dropped == 1  # the request really met a closed connection
    [call] = gw.calls(rollout["rollout_id"])
    assert call["status"] == "ok" and call["upstream"] == relay.url
    # A lost race is not the replica's failure.
    assert _replica(gw)["consecutive_failures"] == 0


def test_a_replica_that_drops_the_request_again_fails_the_call_once(relayed):
    relay, gw, model = relayed
    rollout = gw.new_rollout()
    client = openai.OpenAI(base_url=rollout["openai_base_url"], api_key=rollout["api_key"],
                           max_retries=0, timeout=120)
    relay.drop = 2
    with pytest.raises(openai.APIStatusError) as failed:
        client.chat.completions.create(
            model=model, max_tokens=8, messages=[{"role": "user", "content": "hello?"}])
    assert failed.value.status_code == 502
    assert relay.dropped == 2  # asked once more, not more
    [call] = gw.calls(rollout["rollout_id"])
    assert call["status"] == "failed" and call["error"]
    assert _replica(gw)["consecutive_failures"] == 1
