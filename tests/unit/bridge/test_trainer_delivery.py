"""The bridge's trainer with a `DeliveryWorker`: a finite run trains everything it took (the open
micro-batch trains once no sample comes; `until_empty` ends the run), and a stop between a
step's log entry and its push waits for the push. The real AsyncGRPO trainer on the CPU; the
worker is a list of synthetic samples (tests/support/delivery_worker.py)."""

from __future__ import annotations

import signal

import huggingface_hub.constants
import pytest

from stack.tiny_model import write_tiny_model
from tests.support.delivery_worker import ListDeliveryWorker, synthetic_samples
from trainer_bridge.config import BridgeConfig
from trainer_bridge.trainer import make_trainer
from trainer_bridge.worker import DeliveryWorker

TOKEN_BUDGET = 256


class RecordingTransfer:
    """A weight transfer that keeps nothing but the order of calls (pushes are another test's)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def init_weight_transfer(self) -> None:
        self.calls.append("init")

    def pause(self) -> None:
        self.calls.append("pause")

    def send_weights(self, iterator) -> None:
        for _ in iterator:
            pass
        self.calls.append("send")

    def resume(self) -> None:
        self.calls.append("resume")

    def destroy(self) -> None:
        self.calls.append("destroy")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(autouse=True)
def no_telemetry(monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_TELEMETRY", True)


def _trainer(tiny_model, tmp_path, worker, max_steps: int):
    config = BridgeConfig(model=str(tiny_model), output_dir=tmp_path / "out",
                          max_steps=max_steps, token_budget=TOKEN_BUDGET, learning_rate=1e-4)
    transfer = RecordingTransfer()
    return make_trainer(config, rollout_worker=worker, weight_transfer=transfer), transfer


def test_the_worker_is_recognised_by_its_declared_interface():
    assert isinstance(ListDeliveryWorker([]), DeliveryWorker)

    class PlainTrlWorker:
        rollout_buffer = metrics_queue = None

        def start(self) -> None: ...
        def stop(self) -> None: ...
        def update_model_version(self, model_version: int) -> None: ...
        def check_health(self, stale_after_s: float) -> None: ...

    assert not isinstance(PlainTrlWorker(), DeliveryWorker)


def test_a_micro_batch_that_never_fills_trains_once_no_sample_comes(tiny_model, tmp_path):
    # Three groups of four: far less than a row of 256 unique tokens and loss terms, so TRL's
    # batcher alone would wait for a sample that does not fit, forever.
    worker = ListDeliveryWorker(synthetic_samples(3, 4), flush_after_s=1.0)
    trainer, transfer = _trainer(tiny_model, tmp_path, worker, max_steps=1)
    trainer.train()
    assert trainer.state.global_step == 1
    assert worker.trained() == list(range(12))
    assert worker.acknowledged[0][0] == 1
    assert transfer.calls == ["init"] + ["pause", "send", "resume"] * 2 + ["destroy"]


def test_32_samples_in_8_groups_train_in_2_steps_and_the_run_ends(tiny_model, tmp_path):
    # The shape of a finite run: 8 groups of 4 one-call rollouts, --token-budget 256,
    # --max-steps 2, defaults otherwise: a micro-batch closed by a sample that did not fit, and
    # the rest, trained once no sample came. Every sample it took trains; the run ends.
    samples = synthetic_samples(8, 4)
    worker = ListDeliveryWorker(samples, flush_after_s=1.0)
    trainer, transfer = _trainer(tiny_model, tmp_path, worker, max_steps=2)
    trainer.train()
    assert [step for step, _ in worker.acknowledged] == [1, 2]
    assert worker.trained() == list(range(32))
    assert transfer.calls[-1] == "destroy"
    # Each step logs the metrics of the micro-batch it trained (one row: its samples), the
    # last one included, though the dispatcher collated each one a step ahead.
    logged = [log for log in trainer.state.log_history if "loss" in log]
    assert [log["batch/samples_per_row"] for log in logged] == [
        len(keys) for _, keys in worker.acknowledged]
    # Every token was sampled at version 1, the weights of step 1 (after the cold sync): step 1
    # compares like with like, step 2 (version 2) has no token of its own version.
    assert [log["agreement/same_version_frac"] for log in logged] == [1.0, 0.0]
    assert 1.0 <= logged[0]["agreement/same_version_exp_abs_dlogp"] == logged[0][
        "agreement/exp_abs_dlogp"]
    assert logged[1].get("agreement/same_version_exp_abs_dlogp") is None


def test_until_empty_trains_what_it_took_and_ends_the_run(tiny_model, tmp_path):
    samples = synthetic_samples(8, 4)
    worker = ListDeliveryWorker(samples, flush_after_s=1.0, until_empty=True)
    trainer, _ = _trainer(tiny_model, tmp_path, worker, max_steps=100)
    trainer.train()
    # One micro-batch closed by a sample that did not fit, the rest flushed; then it ended.
    steps = [step for step, _ in worker.acknowledged]
    assert steps == list(range(1, trainer.state.global_step + 1)) and len(steps) >= 2
    assert worker.trained() == list(range(len(samples)))
    assert trainer.state.global_step < 100


def test_a_stop_between_a_steps_log_and_its_push_waits_for_the_push(tiny_model, tmp_path,
                                                                    monkeypatch):
    monkeypatch.setenv("ROLLTAP_STOP_AT", "after_log:1")  # SIGTERM to this process, there
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    worker = ListDeliveryWorker(synthetic_samples(8, 4), flush_after_s=1.0)
    trainer, transfer = _trainer(tiny_model, tmp_path, worker, max_steps=5)
    trainer.stop.install()
    try:
        trainer.train()
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    assert trainer.stop.requested
    # Step 1 was logged when the signal came: it was pushed (its checkpoint written), then the
    # run stopped, with nothing logged after it.
    assert trainer.state.global_step == 1
    assert [step for step, _ in worker.acknowledged] == [1]
    assert transfer.calls == ["init"] + ["pause", "send", "resume"] * 2 + ["destroy"]
