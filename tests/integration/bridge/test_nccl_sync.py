"""`NcclWeightSync` around TRL's real `WeightTransferClient`, whose NCCL side cannot run here.

The engine is a fault stand-in: an HTTP server speaking vLLM's weight-transfer routes that
records every call and fails the ones a test names, so a failed send can be made to happen.
Against the real vLLM (CPU build) the teardown route itself is checked.
"""

from __future__ import annotations

import json
import threading
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from urllib.parse import urlsplit

import pytest
import torch
from accelerate import PartialState

warnings.simplefilter("ignore")
from trl.experimental.async_grpo.vllm_client import VLLMClient  # noqa: E402
from trl.experimental.async_grpo.weight_transfer import WeightTransferClient  # noqa: E402

from trainer_bridge.weights import NcclWeightSync  # noqa: E402


class FaultStandInEngine:
    """A fault stand-in for a vLLM server's RL routes: answers 200 (`{"success": true}`) to
    every POST except the paths in `failing`, which answer 500; records (method, path) in
    order."""

    def __init__(self, failing: set[str]) -> None:
        self.calls: list[tuple[str, str]] = []
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                path = urlsplit(self.path).path
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                engine.calls.append(("POST", self.path))
                status = 500 if path in failing else 200
                body = json.dumps({"success": status == 200} if status == 200 else
                                  {"error": f"fault stand-in: {path} fails"}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def paths(self) -> list[str]:
        return [urlsplit(path).path for _, path in self.calls]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def engine_factory():
    # TRL's client logs through accelerate, whose state the trainer creates in a real run.
    PartialState()
    engines: list[FaultStandInEngine] = []

    def make(failing: set[str] = frozenset()) -> FaultStandInEngine:
        engines.append(FaultStandInEngine(set(failing)))
        return engines[-1]

    yield make
    for engine in engines:
        engine.close()


def _trl_client(url: str, *, joined: bool) -> WeightTransferClient:
    client = WeightTransferClient(
        VLLMClient(url),
        weight_update_info={"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[2]]},
        weight_sync_timeout=30,
    )
    if joined:
        # The NCCL group a real `init_weight_transfer` would have joined cannot exist without
        # GPUs; this placeholder only lets TRL's client take its send path (whose broadcast
        # then fails here as it would on a broken group) and its teardown path.
        client.model_update_group = SimpleNamespace(group=SimpleNamespace(store=1, socket=1))
    return client


def _weights():
    yield "w", torch.zeros(2, dtype=torch.bfloat16)


def test_a_failed_send_resumes_the_engine_and_raises(engine_factory):
    engine = engine_factory(failing={"/update_weights"})
    sync = NcclWeightSync(_trl_client(engine.url, joined=True), engine.url)
    sync.pause()
    with pytest.raises(RuntimeError, match="Weight sync to the vLLM server"):
        sync.send_weights(_weights())
    # TRL never calls resume after a failed send: the wrapper did, after TRL's own cleanup.
    assert engine.paths() == ["/pause", "/start_weight_update", "/update_weights",
                              "/finish_weight_update", "/resume"]
    assert engine.calls[0] == ("POST", "/pause?mode=keep")
    # No prefix-cache reset: nothing new was loaded to justify dropping it.
    assert "/reset_prefix_cache" not in engine.paths()


def test_a_send_drops_the_prefix_cache_before_the_engine_resumes(engine_factory):
    engine = engine_factory()
    # Not joined: TRL's client sends nothing (its behaviour before init), so the send succeeds.
    sync = NcclWeightSync(_trl_client(engine.url, joined=False), engine.url)
    sync.pause()
    sync.send_weights(_weights())
    sync.resume()
    assert engine.paths() == ["/pause", "/reset_prefix_cache", "/resume"]
    assert engine.calls[1] == ("POST", "/reset_prefix_cache?reset_running_requests=true")


def test_destroy_shuts_the_transfer_engine_down_and_releases_the_group(engine_factory):
    engine = engine_factory()
    client = _trl_client(engine.url, joined=True)
    NcclWeightSync(client, engine.url).destroy()
    assert engine.paths() == ["/shutdown_weight_transfer_engine"]
    assert client.model_update_group is None


def test_destroy_releases_the_group_even_when_the_engine_refuses_to_shut_down(engine_factory,
                                                                             caplog):
    engine = engine_factory(failing={"/shutdown_weight_transfer_engine"})
    client = _trl_client(engine.url, joined=True)
    NcclWeightSync(client, engine.url).destroy()
    assert engine.paths() == ["/shutdown_weight_transfer_engine"]
    assert client.model_update_group is None
    assert "could not shut down the transfer engine" in caplog.text


def test_the_real_engine_has_the_teardown_route(vllm_server, engine_factory, caplog):
    # vLLM 0.32 (CPU build, no transfer engine configured): the route exists in dev mode and
    # shutting down an engine nobody joined answers 200.
    client = _trl_client(vllm_server.url, joined=False)
    NcclWeightSync(client, vllm_server.url).destroy()
    assert "could not shut down" not in caplog.text
