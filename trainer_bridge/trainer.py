"""TRL's AsyncGRPO trainer with a choice of loss normalisation, and its construction.

`token` keeps TRL's loss: the clipped per-token surrogate summed and divided by the micro-batch's
trained-token count, so a long rollout (or one merged into many sequences) weighs more than a
short one. `rollout` weighs every rollout the same: each token's loss is weighted by
`1 / (rollouts in the micro-batch * trained tokens of its rollout)`.
"""

import os
from dataclasses import dataclass
from typing import Any, Literal

import torch
from datasets import Dataset
from transformers import PreTrainedTokenizerBase
from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
from trl.experimental.async_grpo.async_grpo_trainer import (
    DataCollatorForRollout,
    RolloutWorkerProtocol,
    WeightTransferProtocol,
)

from trainer_bridge.advantages import rollout_loss_weights
from trainer_bridge.cpu_attention import install_cpu_attention
from trainer_bridge.samples import ROLLOUT_TOKENS_METRIC

LossNormalization = Literal["token", "rollout"]


@dataclass
class RolloutWeightCollator:
    """TRL's collator plus `loss_weight`: per loss term, its rollout-level weight.

    A sample reaches the collator only as `input_ids`, masks, log-probs, advantage, group id and
    `metrics`, so the rollout's size rides in `metrics` (see `samples.ROLLOUT_TOKENS_METRIC`).
    The weights are normalised over the whole micro-batch, all ranks' rows together, since the
    main process collates for every rank.
    """

    inner: DataCollatorForRollout

    def __call__(self, examples: list[Any]) -> dict[str, Any]:
        batch = self.inner(examples)
        (rows,) = examples
        valid = batch["token_index"] >= 0
        rollout_tokens = torch.zeros(valid.shape, dtype=torch.float64)
        for r, row in enumerate(rows):
            try:
                sizes = [sample["metrics"][ROLLOUT_TOKENS_METRIC] for sample in row.samples]
            except KeyError:
                raise ValueError(
                    f"loss_normalization='rollout' needs {ROLLOUT_TOKENS_METRIC!r} in every "
                    "sample's metrics (build samples with trainer_bridge.samples)"
                ) from None
            # Padded terms carry segment id 0, a valid index; `valid` drops them below.
            rollout_tokens[r] = torch.tensor(sizes, dtype=torch.float64)[batch["segment_id"][r]]
        weights = torch.zeros(valid.shape, dtype=torch.float32)
        weights[valid] = torch.from_numpy(
            rollout_loss_weights(rollout_tokens[valid].numpy())
        ).float()
        batch["loss_weight"] = weights
        return batch


class RolltapGRPOTrainer(AsyncGRPOTrainer):
    """`AsyncGRPOTrainer` with `loss_normalization` ("token": TRL's own loss, or "rollout")."""

    def __init__(self, *args: Any, loss_normalization: LossNormalization = "token", **kwargs: Any):
        if loss_normalization not in ("token", "rollout"):
            raise ValueError(
                f"loss_normalization must be 'token' or 'rollout', not {loss_normalization!r}"
            )
        self.loss_normalization = loss_normalization
        super().__init__(*args, **kwargs)

    def get_train_dataloader(self):
        loader = super().get_train_dataloader()
        if self.loss_normalization == "rollout":
            # TRL builds its collator inside this method. Its config forces dispatch_batches, so
            # the loader is accelerate's dispatcher, which collates through `base_dataloader`.
            base = loader.base_dataloader
            base.collate_fn = RolloutWeightCollator(base.collate_fn)
        return loader

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.loss_normalization == "rollout":
            # TRL's loss is sum_t -min(r_t A_t, clip(r_t) A_t) / (tokens / world_size). A positive
            # factor s_t on A_t comes out of the min unchanged, so A_t * w_t * tokens turns it into
            # world_size * sum_t w_t * loss_t, the weighted sum once DDP averages over ranks, and
            # leaves TRL's forward, clipping and metrics (which read only A's sign) as they are.
            scale = inputs["loss_weight"] * inputs["global_n_tokens"][0]
            inputs = {**inputs, "advantages": inputs["advantages"] * scale}
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


def make_trainer(
    model_path: str | os.PathLike,
    *,
    rollout_worker: RolloutWorkerProtocol,
    weight_transfer: WeightTransferProtocol | None,
    output_dir: str | os.PathLike,
    max_steps: int,
    token_budget: int,
    loss_normalization: LossNormalization = "token",
    learning_rate: float = 1e-6,
    max_staleness: int = 4,
    processing_class: PreTrainedTokenizerBase | None = None,
    **config: Any,
) -> RolltapGRPOTrainer:
    """Build the trainer for a rollout worker and a weight transfer of the caller's.

    `token_budget` caps the tokens of one micro-batch row (TRL's token-budget batcher); it must
    be set, since TRL would otherwise ask a vLLM server for its context length. Without CUDA the
    flash-attention kernel is replaced by `cpu_attention`; precision and recomputation follow
    `device_defaults`. `config` overrides
    any `AsyncGRPOConfig` field. `weight_transfer=None` lets TRL build its NCCL transfer to the
    vLLM at `vllm_server_base_url` (a GPU setup).
    """
    if max_steps <= 0:
        # The rollout stream has no length, so the run needs an explicit number of steps.
        raise ValueError("max_steps must be positive")
    cuda = torch.cuda.is_available()
    if cuda:
        load_gpu_attention()
    else:
        install_cpu_attention()
    args = AsyncGRPOConfig(
        **{
            "output_dir": str(output_dir),
            "max_steps": max_steps,
            "token_budget": token_budget,
            "learning_rate": learning_rate,
            "max_staleness": max_staleness,
            **device_defaults("gpu" if cuda else "cpu"),
            **config,
        }
    )
    # TRL requires a prompt dataset, but prompts come from the sandbox runner through the
    # rollout worker: one placeholder row satisfies the check and is never read.
    placeholder = Dataset.from_dict({"prompt": [[{"role": "user", "content": ""}]]})
    return RolltapGRPOTrainer(
        str(model_path),
        args=args,
        train_dataset=placeholder,
        processing_class=processing_class,
        rollout_worker=rollout_worker,
        weight_transfer=weight_transfer,
        loss_normalization=loss_normalization,
    )
