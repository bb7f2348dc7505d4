"""TRL's AsyncGRPO trainer with delivery acknowledgements, a choice of loss normalisation and
optional truncated importance sampling, and its construction from a `BridgeConfig`.

Delivery: every sample from the rollout source carries a number; the collator moves the numbers
of a micro-batch into the batch, `training_step` collects them, and right after each
`optimizer.step()` the source is told which samples that step took (`acknowledge`), before the
weights are pushed. A crash before that call delivers the samples again; after it, never.

`token` keeps TRL's loss: the clipped per-token surrogate summed and divided by the micro-batch's
trained-token count, so a long rollout (or one merged into many sequences) weighs more than a
short one. `rollout` weighs every rollout the same: each token's loss is weighted by
`1 / (rollouts in the micro-batch * trained tokens of its rollout)`.

Truncated importance sampling (`tis`): TRL's loss takes the ratio of the trained policy to the
recorded (sampling) logprobs and clips it. With `tis` the ratio is taken against the trainer's
own logprobs at the start of the step (its value is 1; its gradient is the policy gradient), and
each token is weighted by `min(C, exp(trainer logprob - recorded logprob))`, as TRL's
synchronous GRPO corrects for vLLM's sampling: a mismatch between engine and trainer then
re-weights a token instead of clipping it away.
"""

from collections.abc import Iterator
from typing import Any, Literal, cast

import torch
from datasets import Dataset
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerBase, TrainerCallback
from trl.experimental.async_grpo.async_grpo_config import AsyncGRPOConfig
from trl.experimental.async_grpo.async_grpo_trainer import (
    AsyncGRPOTrainer,
    DataCollatorForRollout,
    RolloutQueueDataset,
    RolloutWorkerProtocol,
    WeightTransferProtocol,
)

from trainer_bridge.collators import (
    DeliveryCollator,
    HeldMetrics,
    RolloutWeightCollator,
    VersionCollator,
)
from trainer_bridge.config import BridgeConfig
from trainer_bridge.cpu_attention import install_cpu_attention
from trainer_bridge.faults import crash_point
from trainer_bridge.handover import FlushingBatcher, StreamEnded
from trainer_bridge.stopping import StepEndStop
from trainer_bridge.worker import DeliveryWorker

LossNormalization = Literal["token", "rollout"]
ImportanceSampling = Literal["none", "tis"]


def tis_weights(trainer_logprobs: torch.Tensor, recorded_logprobs: torch.Tensor, cap: float):
    """Truncated importance weights, per token: `min(cap, exp(trainer - recorded))`."""
    return torch.exp(trainer_logprobs - recorded_logprobs).clamp(max=cap)


class _TruncatedIS:
    """The policy model as TRL's `compute_loss` calls it, with each trained token's log-prob
    replaced by `w * (lp - sg(lp))`, `w` its truncated importance weight.

    TRL's loss is `-min(r A, clip(r) A)` with `r = exp(lp - old)`. With `old = 0` on trained
    tokens, `r` is 1 (no clipping) and its gradient `w * grad lp`: the loss becomes the policy
    gradient weighted per token, in one forward pass and with TRL's own loss code.
    """

    def __init__(self, model, token_index, recorded, cap: float, metrics) -> None:
        self.model, self.token_index, self.recorded, self.cap = model, token_index, recorded, cap
        self.metrics = metrics

    def __call__(self, **kwargs):
        outputs = self.model(**kwargs)
        flat = outputs.log_probs.flatten()
        lp = flat[self.token_index]
        ratio = torch.exp(lp.detach() - self.recorded)
        weights = ratio.clamp(max=self.cap)
        tilted = flat.index_put((self.token_index,), weights * (lp - lp.detach()))
        outputs.log_probs = tilted.view_as(outputs.log_probs)
        if ratio.numel():
            self.metrics["tis/ratio_mean"].append(ratio.mean().item())
            self.metrics["tis/weight_mean"].append(weights.mean().item())
            self.metrics["tis/weight_min"].append(weights.min().item())
            self.metrics["tis/capped_frac"].append(
                ((ratio > self.cap).sum().item(), float(ratio.numel())))
        return outputs


class Agreement:
    """The policy model as TRL's `compute_loss` calls it, unchanged, recording how far the
    trainer's log-probs of the trained tokens are from the sampler's recorded ones, before this
    step's update: the mean of exp|lp - recorded| (a rate, so the step's value is over all its
    tokens) and its worst token, NeMo RL's sampler/trainer agreement (1.0 = identical).

    Over all trained tokens (`agreement/exp_abs_dlogp`) the value also holds the policy's
    movement since a stale token was sampled. With per-token `versions`, it is also taken over
    the tokens sampled by the weights the trainer holds now (`agreement/same_version_*`): the
    engine's and the trainer's numerics alone, the comparison NeMo RL's 1.05 is meant for."""

    def __init__(self, model, token_index, recorded, metrics, versions=None,
                 current: int = 0) -> None:
        self.model, self.token_index, self.recorded = model, token_index, recorded
        self.metrics, self.versions, self.current = metrics, versions, current

    def __call__(self, **kwargs):
        outputs = self.model(**kwargs)
        lp = outputs.log_probs.detach().flatten()[self.token_index]
        if lp.numel():
            gap = torch.exp((lp - self.recorded).abs())
            self._record("agreement/exp_abs_dlogp", gap)
            if self.versions is not None:
                same = self.versions == self.current
                self.metrics["agreement/same_version_frac"].append(
                    (same.sum().item(), float(same.numel())))
                if same.any():
                    self._record("agreement/same_version_exp_abs_dlogp", gap[same])
        return outputs

    def _record(self, name: str, gap: torch.Tensor) -> None:
        self.metrics[name].append((gap.sum().item(), float(gap.numel())))
        self.metrics[f"{name}_max"].append(gap.max().item())


class _Acknowledge(TrainerCallback):
    """Tells the rollout source which samples the optimizer step just took (before the push)."""

    def __init__(self, trainer: "RolltapGRPOTrainer", worker: DeliveryWorker) -> None:
        self.trainer = trainer
        self.worker = worker

    def on_optimizer_step(self, args, state, control, **kwargs):
        # From here to the end of the step's push a stop waits (trainer_bridge/stopping.py).
        self.trainer.stop.hold()
        crash_point("after_step")
        numbers, self.trainer.step_deliveries = self.trainer.step_deliveries, []
        # `global_step` counts the step once it is over, which this one is but for the count.
        self.worker.acknowledge(state.global_step + 1, numbers)
        crash_point("after_log")


class _RunLength(TrainerCallback):
    """Tells the rollout source how many micro-batches the run has left once it knows (a
    resumed run knows its step only here), so it takes no sample the run would not train."""

    def __init__(self, worker: DeliveryWorker) -> None:
        self.worker = worker

    def on_train_begin(self, args, state, control, **kwargs):
        left = (args.max_steps - state.global_step) * args.gradient_accumulation_steps
        self.worker.open_batch.micro_batches_left = max(0, left)


class RolltapGRPOTrainer(AsyncGRPOTrainer):
    """`AsyncGRPOTrainer` with delivery acknowledgements and the flush of a partial micro-batch
    (for a rollout worker that is a `DeliveryWorker`), `loss_normalization` ("token": TRL's own
    loss, or "rollout") and `importance_sampling` ("none", or "tis" with `tis_cap`)."""

    def __init__(
        self,
        *args: Any,
        loss_normalization: LossNormalization = "token",
        importance_sampling: ImportanceSampling = "none",
        tis_cap: float = 2.0,
        **kwargs: Any,
    ):
        if loss_normalization not in ("token", "rollout"):
            raise ValueError(
                f"loss_normalization must be 'token' or 'rollout', not {loss_normalization!r}"
            )
        if importance_sampling not in ("none", "tis"):
            raise ValueError(
                f"importance_sampling must be 'none' or 'tis', not {importance_sampling!r}"
            )
        self.loss_normalization = loss_normalization
        self.importance_sampling = importance_sampling
        self.tis_cap = tis_cap
        self.step_deliveries: list[int] = []  # sample numbers the current step has trained on
        self.held_metrics = HeldMetrics()
        super().__init__(*args, **kwargs)
        # After TRL's push callback, so a stop held for a step waits for its push.
        self.stop = StepEndStop()
        self.add_callback(self.stop)
        worker = self.rollout_worker
        self.delivery_worker = worker if isinstance(worker, DeliveryWorker) else None
        if self.delivery_worker is not None:
            self.add_callback(_Acknowledge(self, self.delivery_worker))
            self.add_callback(_RunLength(self.delivery_worker))

    def get_train_dataloader(self):
        worker = self.delivery_worker
        args = cast(AsyncGRPOConfig, self.args)
        held = None
        if (worker is not None and self.accelerator.is_main_process
                and (args.token_budget or 0) > 0):
            loader, held = self._flushing_loader(worker, args), self.held_metrics
        else:
            loader = super().get_train_dataloader()
        # TRL builds its collator inside this method. Its config forces dispatch_batches, so
        # the loader is accelerate's dispatcher, which collates through `base_dataloader`.
        base = cast(Any, loader).base_dataloader
        if self.loss_normalization == "rollout":
            base.collate_fn = RolloutWeightCollator(base.collate_fn)
        base.collate_fn = VersionCollator(DeliveryCollator(base.collate_fn, held))
        return loader

    def _flushing_loader(self, worker: DeliveryWorker, args: AsyncGRPOConfig) -> DataLoader[Any]:
        """TRL's loader (its queue reader, token-budget batcher and packer), with the batcher
        that also trains an open micro-batch once no sample comes (trainer_bridge/handover.py).
        TRL builds its batcher inside `get_train_dataloader`, so the loader is built here the
        same way, with that one part changed."""
        metrics = self._metrics["train"]
        dataset = RolloutQueueDataset(
            rollout_queue=self.rollout_queue,
            model_version_fn=lambda: self.model_version,
            check_health_fn=worker.check_health,
            stale_after_s=args.heartbeat_stale_after_s,
            metrics=metrics,
            max_staleness=args.max_staleness,
            report_to=args.report_to,
        )
        # TRL flushes the queue wait into its step metrics through this attribute.
        self._rollout_dataset = dataset
        processes = self.accelerator.num_processes
        budget = args.token_budget or 0
        batcher = FlushingBatcher(dataset, processes, budget, metrics, worker.open_batch)
        tokenizer = cast(PreTrainedTokenizerBase, self.processing_class)
        collator = DataCollatorForRollout(
            cast(int, tokenizer.pad_token_id), processes, groups_trained=self._trained_groups,
            metrics=self.held_metrics.sink, token_budget=budget)
        return self.accelerator.prepare(
            DataLoader(batcher, batch_size=1, collate_fn=collator, num_workers=0))

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        return super().get_batch_samples(self._until_stream_ends(epoch_iterator), num_batches,
                                         device)

    def _until_stream_ends(self, batches: Iterator[Any]) -> Iterator[Any]:
        """The epoch's micro-batches, until the rollout stream ends (`StreamEnded` says why):
        then training stops, as after its last step."""
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            except StreamEnded as ended:
                print(f"rolltap bridge: {ended}: the run ends", flush=True)
                self.control.should_training_stop = True
                return
            yield batch

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.held_metrics.release(self._metrics["train"])
        numbers = inputs.pop("delivery_ids", None)
        if numbers is not None and self.accelerator.is_main_process:
            self.step_deliveries.extend(numbers[0].tolist())
        crash_point("during_step")
        try:
            return super().training_step(model, inputs, num_items_in_batch)
        except Exception:
            # These samples could not be trained: a fault of their groups, not of the bridge.
            if numbers is not None and self.delivery_worker is not None:
                self.delivery_worker.fault(numbers[0].tolist())
            raise

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.loss_normalization == "rollout":
            # TRL's loss is sum_t -min(r_t A_t, clip(r_t) A_t) / (tokens / world_size). A positive
            # factor s_t on A_t comes out of the min unchanged, so A_t * w_t * tokens turns it into
            # world_size * sum_t w_t * loss_t, the weighted sum once DDP averages over ranks, and
            # leaves TRL's forward, clipping and metrics (which read only A's sign) as they are.
            scale = inputs["loss_weight"] * inputs["global_n_tokens"][0]
            inputs = {**inputs, "advantages": inputs["advantages"] * scale}
        selected = inputs["token_index"] >= 0
        versions = inputs.get("token_version")
        model = cast(Any, Agreement)(model, inputs["token_index"][selected],
                                      inputs["old_log_probs"][selected], self._metrics["train"],
                                      None if versions is None else versions[selected],
                                      self.model_version)
        if self.importance_sampling == "tis":
            model = cast(Any, _TruncatedIS)(
                model,
                inputs["token_index"][selected],
                inputs["old_log_probs"][selected],
                self.tis_cap,
                self._metrics["train"],
            )
            inputs = {**inputs, "old_log_probs": torch.zeros_like(inputs["old_log_probs"])}
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


class KernelUnavailable(RuntimeError):
    """TRL's flash-attention kernel for CUDA could not be loaded; the message says what to do."""


def load_gpu_attention() -> None:
    """Load the flash-attention kernel TRL's packed attention runs on CUDA now, not at the first
    forward pass after the model is loaded and the run has begun.

    TRL fetches it from the Hugging Face Hub through the `kernels` package (the gpu extra); it
    is cached after the first fetch, and with HF_HUB_OFFLINE=1 only the cache is read.
    """
    from trl.experimental.async_grpo import packing

    try:
        packing._flash_attn()
    except ImportError as exc:
        raise KernelUnavailable(
            f"TRL's packed attention on CUDA needs the `kernels` package ({exc}); install the "
            "gpu extra: pip install 'rolltap[gpu,train]'"
        ) from exc
    except Exception as exc:
        raise KernelUnavailable(
            "TRL's packed attention on CUDA loads the flash-attention kernel from the Hugging "
            f"Face Hub (kernels-community/flash-attn3), and that failed: {exc!r}. Run once with "
            "access to huggingface.co (the kernel is cached afterwards), or unset "
            "HF_HUB_OFFLINE if it is set and the cache does not hold the kernel yet."
        ) from exc


def device_defaults(device: str) -> dict[str, Any]:
    """The `AsyncGRPOConfig` fields that depend on where training runs ("cpu" or "gpu").

    On GPUs the policy loads in bfloat16 (TRL's own default is float32: a full fine-tune of an
    8B model with AdamW would then need about 130 GB on one GPU, and vLLM serves in bfloat16
    there, see serve_model.DEFAULT_DTYPE), with bf16 autocast and gradient checkpointing. On a
    CPU: float32, and no recomputation (it saves memory a CPU run does not lack).
    """
    if device not in ("cpu", "gpu"):
        raise ValueError(f"device must be 'cpu' or 'gpu', not {device!r}")
    gpu = device == "gpu"
    return {
        "dtype": "bfloat16" if gpu else "float32",
        "bf16": gpu,
        "gradient_checkpointing": gpu,
    }


def trainer_fields(config: BridgeConfig, device: str) -> dict[str, Any]:
    """The `AsyncGRPOConfig` fields of `config` when training on `device` ("cpu" or "gpu"):
    what `make_trainer` builds the trainer with and what `rolltap bridge --print-config` shows."""
    return {
        "output_dir": str(config.output_dir),
        "max_steps": config.max_steps,
        "token_budget": config.token_budget,
        "learning_rate": config.learning_rate,
        "max_staleness": config.max_staleness,
        "temperature": config.temperature,
        "num_generations": config.num_generations,
        **({"vllm_server_base_url": config.vllm[0]} if config.vllm else {}),
        **device_defaults(device),
        # Checkpoints are the disk sync's, which add the trainer's state (trainer_bridge.resume).
        "save_strategy": "no",
        # A resume must not fast-forward the rollout stream: that would train nothing on the
        # rollouts it skips, while their leases are held.
        "ignore_data_skip": True,
        "report_to": "none",
        "disable_tqdm": True,
        **config.overrides,
    }


def make_trainer(
    config: BridgeConfig,
    *,
    rollout_worker: RolloutWorkerProtocol,
    weight_transfer: WeightTransferProtocol | None,
    processing_class: PreTrainedTokenizerBase | None = None,
) -> RolltapGRPOTrainer:
    """Build the trainer of `config` for a rollout worker and a weight transfer of the caller's.

    `config.token_budget` caps the tokens of one micro-batch row (TRL's token-budget batcher);
    it must be set, since TRL would otherwise ask a vLLM server for its context length. Without
    CUDA the flash-attention kernel is replaced by `cpu_attention`; precision and recomputation
    follow `device_defaults`.
    `config.overrides` sets any other `AsyncGRPOConfig` field. `weight_transfer=None` lets TRL
    build its NCCL transfer to the vLLM at `config.vllm[0]` (a GPU setup).
    """
    if config.max_steps <= 0:
        # The rollout stream has no length, so the run needs an explicit number of steps.
        raise ValueError("max_steps must be positive")
    cuda = torch.cuda.is_available()
    if cuda:
        load_gpu_attention()
    else:
        install_cpu_attention()
    args = AsyncGRPOConfig(**trainer_fields(config, "gpu" if cuda else "cpu"))
    # TRL requires a prompt dataset, but prompts come from the sandbox runner through the
    # rollout worker: one placeholder row satisfies the check and is never read.
    placeholder = Dataset.from_dict({"prompt": [[{"role": "user", "content": ""}]]})
    return RolltapGRPOTrainer(
        str(config.model),
        args=args,
        train_dataset=placeholder,
        processing_class=processing_class,
        rollout_worker=rollout_worker,
        weight_transfer=weight_transfer,
        loss_normalization=config.loss_normalization,
        importance_sampling=config.importance_sampling,
        tis_cap=config.tis_cap,
    )
