"""The real AsyncGRPO trainer on the CPU, fed RolloutSamples built by samples.py.

Sequences are synthetic (no model server is involved) but everything past them is the real path:
advantages, sample conversion, TRL's queue, planner, tree packing, the CPU attention kernel, the
clipped loss, the optimizer and the weight-sync calls.
"""

import math
import queue
import threading
import time

import huggingface_hub.constants
import numpy as np
import pytest
import torch
from trl.experimental.async_grpo.async_grpo_trainer import DataCollatorForRollout
from trl.experimental.async_grpo.packing import TreeRow

from stack.tiny_model import VOCAB_SIZE, write_tiny_model
from tests.support.sequences import Seq
from trainer_bridge.advantages import group_advantages
from trainer_bridge.collators import RolloutWeightCollator
from trainer_bridge.config import BridgeConfig
from trainer_bridge.samples import ROLLOUT_TOKENS_METRIC, rollout_samples
from trainer_bridge.trainer import make_trainer, tis_weights

TOKEN_BUDGET = 256
# The tiny model starts near uniform, so a sampled token's log-probability is about -log(V).
UNIFORM_LOGPROB = -math.log(VOCAB_SIZE)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(autouse=True)
def no_telemetry(monkeypatch):
    # TRL pings the Hub when a trainer is built; this machine only reaches 127.0.0.1.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_TELEMETRY", True)


def synthetic_sequence(rng, prompt, turns, version):
    """Prompt, then alternating sampled turns (trained) and tool results (context)."""
    ids, mask = [prompt], [np.zeros(len(prompt), np.uint8)]
    for i, length in enumerate(turns):
        ids.append(rng.integers(0, VOCAB_SIZE, length))
        mask.append(np.full(length, 1 if i % 2 == 0 else 0, np.uint8))
    ids, mask = np.concatenate(ids).astype(np.int32), np.concatenate(mask)
    logprobs = np.where(mask, UNIFORM_LOGPROB + rng.normal(0, 0.05, len(ids)), 0.0)
    return Seq(
        input_ids=ids,
        loss_mask=mask,
        logprobs=logprobs.astype(np.float32),
        versions=np.where(mask, version, -1).astype(np.int32),
        call_ids=np.zeros(len(ids), np.int64),
    )


def synthetic_rollout(rng, prompt, version):
    """One rollout: 1-3 merged sequences; a later one forks from the first after the prompt."""
    first = synthetic_sequence(rng, prompt, rng.integers(4, 24, rng.integers(1, 4)), version)
    forks = [
        synthetic_sequence(rng, prompt, rng.integers(4, 24, 1), version)
        for _ in range(rng.integers(0, 3))
    ]
    return [first, *forks]


class SyntheticRolloutWorker:
    """TRL's rollout-worker protocol over synthetic groups (a test double for the bridge's
    source of merged sequences; everything it hands the trainer is built by samples.py)."""

    def __init__(self, seed=0, group_size=4):
        self.rollout_buffer = queue.Queue(maxsize=32)
        self.metrics_queue = queue.Queue()
        self.versions = []
        self._rng = np.random.default_rng(seed)
        self._group_size = group_size
        self._stop = threading.Event()
        self._thread = None
        self._error = None

    def start(self):
        self._thread = threading.Thread(target=self._run, name="synthetic-rollouts", daemon=True)
        self._thread.start()

    def stop(self):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def update_model_version(self, model_version):
        self.versions.append(model_version)

    def check_health(self, stale_after_s):
        if self._error is not None:
            raise RuntimeError("synthetic rollout worker failed") from self._error
        if self._thread is None or not self._thread.is_alive():
            raise RuntimeError("synthetic rollout worker is not running")

    def _run(self):
        try:
            group_id = 0
            while not self._stop.is_set():
                self._emit_group(group_id)
                group_id += 1
        except Exception as error:  # surfaced to the trainer through check_health
            self._error = error

    def _emit_group(self, group_id):
        rng, version = self._rng, self.versions[-1]
        prompt = rng.integers(0, VOCAB_SIZE, rng.integers(8, 40))
        rollouts = [synthetic_rollout(rng, prompt, version) for _ in range(self._group_size)]
        # One sequence over the budget per group: it must be skipped, never truncated.
        rollouts[0].append(synthetic_sequence(rng, prompt, [TOKEN_BUDGET], version))
        rewards = [float(rng.integers(0, 2)) for _ in rollouts[:-1]] + [None]
        skipped = 0
        for seqs, advantage, reward in zip(
            rollouts, group_advantages(rewards), rewards, strict=True
        ):
            samples, reasons = rollout_samples(
                seqs, advantage=advantage, group_id=group_id, max_tokens=TOKEN_BUDGET, reward=reward
            )
            skipped += sum(reason is not None for reason in reasons)
            for sample in samples:
                sample.enqueued_at = time.time()
                while not self._stop.is_set():
                    try:
                        self.rollout_buffer.put(sample, timeout=0.2)
                        break
                    except queue.Full:
                        continue
        self.metrics_queue.put({"rollout/skipped_sequences_total": float(skipped)})


class NoOpWeightTransfer:
    """Weight transfer that sends nothing anywhere (pushing to vLLM is another module's job);
    it records what the trainer asked of it."""

    def __init__(self):
        self.calls = []
        self.sent_names = []

    def init_weight_transfer(self):
        self.calls.append("init")

    def pause(self):
        self.calls.append("pause")

    def send_weights(self, iterator):
        self.calls.append("send")
        self.sent_names.append([name for name, _tensor in iterator])

    def resume(self):
        self.calls.append("resume")

    def destroy(self):
        self.calls.append("destroy")


@pytest.mark.parametrize("loss_normalization", ["token", "rollout"])
def test_trains_on_cpu_and_syncs_after_every_step(tiny_model, tmp_path, loss_normalization):
    steps = 3
    worker, transfer = SyntheticRolloutWorker(), NoOpWeightTransfer()
    config = BridgeConfig(model=str(tiny_model), output_dir=tmp_path / "out", max_steps=steps,
                          token_budget=TOKEN_BUDGET, loss_normalization=loss_normalization,
                          learning_rate=1e-4)
    trainer = make_trainer(config, rollout_worker=worker, weight_transfer=transfer)
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}

    t0 = time.perf_counter()
    result = trainer.train()
    elapsed = time.perf_counter() - t0

    assert trainer.state.global_step == steps
    assert math.isfinite(result.training_loss)
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == steps and all(math.isfinite(entry["loss"]) for entry in logged)
    assert any(entry["loss"] != 0.0 for entry in logged)
    # Sampler/trainer agreement of every step's trained tokens: exp|dlogp| >= 1, mean <= worst.
    for entry in logged:
        assert 1.0 <= entry["agreement/exp_abs_dlogp"] <= entry["agreement/exp_abs_dlogp_max"]
    assert sum(entry.get("rollout/skipped_sequences_total", 0.0) for entry in logged) > 0

    after = dict(trainer.model.named_parameters())
    # A key bias shifts every score of a query equally, so softmax cancels its gradient.
    unchanged = [
        name
        for name, p in after.items()
        if "k_proj.bias" not in name and torch.equal(p.detach(), before[name])
    ]
    assert unchanged == []

    # Cold sync before the worker starts, then one sync (and version bump) per optimizer step.
    assert transfer.calls == ["init"] + ["pause", "send", "resume"] * (steps + 1) + ["destroy"]
    assert all(names == list(before) for names in transfer.sent_names)
    assert worker.versions == list(range(1, steps + 2))
    assert not worker._thread.is_alive()

    step_s = [entry["perf/step_s"] for entry in logged if "perf/step_s" in entry]
    forwarded = [entry.get("batch/forwarded_tokens_per_step") for entry in logged]
    print(
        f"\n[{loss_normalization}] {steps} steps in {elapsed:.2f}s; "
        f"perf/step_s={', '.join(f'{s:.2f}' for s in step_s)}; "
        f"forwarded tokens/step={forwarded}"
    )


def _rollout_batch(collator, rollouts):
    """One micro-batch row holding whole rollouts, collated the way the trainer does it."""
    row = TreeRow()
    for samples in rollouts:
        for s in samples:
            row.add(
                {
                    "input_ids": s.input_ids,
                    "completion_mask": s.completion_mask,
                    "old_log_probs": s.old_log_probs,
                    "advantage": s.advantage,
                    "group_id": s.group_id,
                    "metrics": s.metrics,
                }
            )
    return collator([[row]])


def _policy_logprobs(model, batch):
    """The model's log-probability of every loss term of a collated batch (its tree forward)."""
    max_q, max_k = batch["tree_max_seqlens"][0].tolist()
    out = model(
        input_ids=batch["input_ids"],
        position_ids=batch["position_ids"],
        shift_labels=batch["shift_labels"],
        fused_lm_head=True,
        tree_kv_index=batch["tree_kv_index"][0],
        tree_cu_seqlens_q=batch["tree_cu_seqlens_q"][0],
        tree_cu_seqlens_k=batch["tree_cu_seqlens_k"][0],
        tree_max_seqlen_q=max_q,
        tree_max_seqlen_k=max_k,
    )
    return out.log_probs.flatten()[batch["token_index"]]


def test_rollout_normalisation_weighs_every_rollout_the_same(tiny_model, tmp_path):
    """With the old log-probs equal to the model's own, every ratio is 1 and a token's loss is
    -A: the token mean is -sum_t A_t / N, the rollout mean -sum_r A_r / R, whatever the rollouts'
    lengths and sequence counts."""
    trainer = make_trainer(
        BridgeConfig(model=str(tiny_model), output_dir=tmp_path / "out", max_steps=1,
                     token_budget=TOKEN_BUDGET, loss_normalization="rollout"),
        rollout_worker=SyntheticRolloutWorker(),
        weight_transfer=NoOpWeightTransfer(),
    )
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, VOCAB_SIZE, 12)
    shapes = [[[30, 5, 40]], [[4]], [[10], [6], [12]]]  # long; short; three forked sequences
    advantages = [1.5, -0.5, 0.75]
    rollouts = [
        rollout_samples(
            [synthetic_sequence(rng, prompt, turns, 0) for turns in seqs],
            advantage=adv,
            group_id=0,
            max_tokens=TOKEN_BUDGET,
        )[0]
        for seqs, adv in zip(shapes, advantages, strict=True)
    ]
    collator = RolloutWeightCollator(DataCollatorForRollout(trainer.processing_class.pad_token_id))
    batch = _rollout_batch(collator, rollouts)
    with torch.no_grad():
        batch["old_log_probs"] = _policy_logprobs(trainer.model, batch)
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop on every step

    rollout_loss = trainer.compute_loss(trainer.model, batch)
    trainer.loss_normalization = "token"
    token_loss = trainer.compute_loss(trainer.model, batch)

    tokens = [sum(int(s.completion_mask.sum()) for s in samples) for samples in rollouts]
    assert [s.metrics[ROLLOUT_TOKENS_METRIC] for samples in rollouts for s in samples] == [
        t for t, samples in zip(tokens, rollouts, strict=True) for _ in samples
    ]
    expected_token = -sum(a * t for a, t in zip(advantages, tokens, strict=True)) / sum(tokens)
    expected_rollout = -sum(advantages) / len(advantages)
    assert token_loss.item() == pytest.approx(expected_token, rel=1e-4)
    assert rollout_loss.item() == pytest.approx(expected_rollout, rel=1e-4)
    assert abs(expected_token - expected_rollout) > 0.1


def test_rollout_weights_need_the_rollout_size():
    collator = RolloutWeightCollator(DataCollatorForRollout(0))
    row = TreeRow()
    row.add(
        {
            "input_ids": np.arange(4),
            "completion_mask": np.array([0, 1, 1, 1]),
            "old_log_probs": np.zeros(4, np.float32),
            "advantage": 1.0,
            "group_id": 0,
            "metrics": {},
        }
    )
    with pytest.raises(ValueError, match=ROLLOUT_TOKENS_METRIC):
        collator([[row]])


def test_tis_weights_by_hand():
    trainer = torch.tensor([-1.0, -2.0, -0.5, -3.0, -0.1])
    recorded = torch.tensor([-1.0, -1.0, -1.5, -2.0, -3.1])
    # exp(0) = 1; exp(-1) = 0.3679; exp(1) = 2.7183 -> cap 2; exp(-1); exp(3) = 20.09 -> cap 2
    expected = [1.0, 0.36787944, 2.0, 0.36787944, 2.0]
    np.testing.assert_allclose(tis_weights(trainer, recorded, 2.0).numpy(), expected, rtol=1e-6)
    np.testing.assert_allclose(tis_weights(trainer, recorded, 5.0)[2].item(), math.e, rtol=1e-6)


def test_tis_loss_is_the_policy_gradient_weighted_per_token(tiny_model, tmp_path):
    """With TIS on, the gradient of TRL's loss is that of -sum_t w_t A_t lp_t / N, with
    w_t = min(C, exp(lp_t - recorded_t)); the weights are logged."""
    cap = 1.5
    trainer = make_trainer(
        BridgeConfig(model=str(tiny_model), output_dir=tmp_path / "out", max_steps=1,
                     token_budget=TOKEN_BUDGET, importance_sampling="tis", tis_cap=cap),
        rollout_worker=SyntheticRolloutWorker(),
        weight_transfer=NoOpWeightTransfer(),
    )
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, VOCAB_SIZE, 10)
    rollouts = [
        rollout_samples([synthetic_sequence(rng, prompt, [12, 3, 9], 0)], advantage=adv,
                        group_id=0, max_tokens=TOKEN_BUDGET)[0]
        for adv in (1.0, -0.5)
    ]
    batch = _rollout_batch(DataCollatorForRollout(trainer.processing_class.pad_token_id),
                           rollouts)
    model = trainer.model
    with torch.no_grad():
        own = _policy_logprobs(model, batch).flatten()
    # Recorded logprobs off from the trainer's by known amounts: some weights capped, some not.
    offsets = torch.from_numpy(rng.uniform(-1.0, 1.0, own.shape)).float()
    batch["old_log_probs"] = (own + offsets).view(1, -1)
    weights = tis_weights(own, own + offsets, cap)
    assert (weights == cap).any() and (weights < 1).any()
    trainer.current_gradient_accumulation_steps = 1

    model.zero_grad()
    trainer.compute_loss(model, batch).backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    model.zero_grad()
    advantages = batch["advantages"][batch["token_index"] >= 0]
    logprobs = _policy_logprobs(model, batch).flatten()
    expected_loss = -(weights * advantages * logprobs).sum() / len(own)
    expected_loss.backward()
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(got[name], p.grad, rtol=1e-4, atol=1e-7)
    logged = trainer._metrics["train"]
    assert logged["tis/weight_mean"][-1] == pytest.approx(weights.mean().item(), rel=1e-5)
    capped = (offsets < -math.log(cap)).sum().item()
    assert logged["tis/capped_frac"][-1] == (capped, float(len(own)))
