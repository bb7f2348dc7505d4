"""`NcclWeightSync` around TRL's real `WeightTransferClient`, whose NCCL side cannot run here;
and an NCCL run's resumable state, written every --state-every pushes by the disk writer from
the same pass over the weights, with the NCCL transfer itself faked (no GPU here).

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
from safetensors.torch import load_file  # noqa: E402
from trl.experimental.async_grpo.vllm_client import VLLMClient  # noqa: E402
from trl.experimental.async_grpo.weight_transfer import WeightTransferClient  # noqa: E402

from stack.tiny_model import write_tiny_model  # noqa: E402
from tests.support.delivery_worker import ListDeliveryWorker, synthetic_samples  # noqa: E402
from trainer_bridge import resume  # noqa: E402
from trainer_bridge.config import BridgeConfig  # noqa: E402
from trainer_bridge.resume import StateWriter  # noqa: E402
from trainer_bridge.trainer import make_trainer  # noqa: E402
from trainer_bridge.weights import NcclWeightSync, StateCheckpoints  # noqa: E402


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


# -- resuming an NCCL run --------------------------------------------------------------------


class FakeNcclTransfer:
    """A fake of TRL's NCCL `WeightTransferClient` for a machine without GPUs: it takes every
    tensor the trainer streams, as the broadcast would, and keeps their names and values."""

    def __init__(self) -> None:
        self.pushes: list[dict[str, torch.Tensor]] = []

    def init_weight_transfer(self) -> None:
        pass

    def pause(self) -> None:
        pass

    def send_weights(self, iterator) -> None:
        self.pushes.append({name: tensor.detach().clone() for name, tensor in iterator})

    def resume(self) -> None:
        pass

    def destroy(self) -> None:
        pass


def _nccl_run(model, engine, checkpoint_dir, out, *, max_steps, state_every, history,
              resume_from=None):
    """A CPU trainer whose weights go through `NcclWeightSync` (the transfer itself faked) with
    resumable state every `state_every` pushes, trained for `max_steps` on synthetic samples."""
    config = BridgeConfig(model=str(model), output_dir=out, max_steps=max_steps,
                          token_budget=256, learning_rate=1e-3, state_every=state_every)
    fake = FakeNcclTransfer()
    state = StateCheckpoints(model, checkpoint_dir, due=lambda: False, keep=100,
                             protected=[resume_from] if resume_from else [])
    worker = ListDeliveryWorker(synthetic_samples(24, 4, seed=max_steps), flush_after_s=1.0)
    trainer = make_trainer(config, rollout_worker=worker,
                           weight_transfer=NcclWeightSync(fake, engine.url, state=state))
    state.due = lambda: trainer.state.global_step % state_every == 0
    state.add_state = StateWriter(trainer, f"nccl-{max_steps}", history, state_every)
    trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
    return trainer, worker, fake


def test_an_nccl_run_writes_state_every_n_pushes_and_resumes_from_it(engine_factory, tmp_path,
                                                                     monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_TELEMETRY", True)
    model = write_tiny_model(tmp_path / "model")
    engine = engine_factory()
    checkpoints = tmp_path / "ckpt"
    trainer, worker, fake = _nccl_run(model, engine, checkpoints, tmp_path / "a", max_steps=3,
                                      state_every=2, history={})
    assert trainer.state.global_step == 3 and len(fake.pushes) == 4  # cold sync + 3 steps
    # Checkpoints at the pushes of step 0 and step 2 only, each what NCCL sent, with the state.
    written = sorted(p.name for p in checkpoints.iterdir())
    assert written == ["policy-000001", "policy-000002"]
    newest = resume.newest_resumable(checkpoints)
    assert newest is not None and newest.name == "policy-000002"
    assert resume.read_history(newest) == {"nccl-3": 2}
    on_disk = load_file(str(newest / "model.safetensors"))
    assert on_disk.keys() == fake.pushes[2].keys()
    assert all(torch.equal(on_disk[name], fake.pushes[2][name]) for name in on_disk)

    # Resumed: from step 2, with its weights and optimizer; steps 3 and 4 trained anew.
    resumed, worker2, fake2 = _nccl_run(model, engine, checkpoints, tmp_path / "b",
                                        max_steps=4, state_every=2,
                                        history=resume.read_history(newest), resume_from=newest)
    assert resumed.state.global_step == 4
    assert [step for step, _ in worker2.acknowledged] == [3, 4]
    # Its cold sync sent the weights it resumed with.
    assert all(torch.equal(fake2.pushes[0][name], on_disk[name]) for name in on_disk)
    # Its first checkpoint (the cold push, at step 2) holds the optimizer state it resumed with.
    first = checkpoints / "policy-000003"
    old, new = (torch.load(p / "optimizer.pt", weights_only=True) for p in (newest, first))
    assert old["state"] and old["state"].keys() == new["state"].keys()
    for key, moments in old["state"].items():
        for name, value in moments.items():
            assert torch.equal(value, new["state"][key][name]), (key, name)
    assert resume.read_history(checkpoints / "policy-000004") == {"nccl-3": 2, "nccl-4": 4}
    assert "/reset_prefix_cache" in engine.paths()
