"""Merged training sequences -> TRL `RolloutSample`s (pure conversion).

TRL's trainer reads a sample as three arrays of the length of `input_ids`: int64 ids, an int64
mask (1 = trained), float32 log-probabilities where the log-probability of token `i` sits at
index `i` and context positions hold 0. Which tokens train is the trace's loss mask: the merge
already left out context, auxiliary calls and the spans of calls it flagged (constrained
sampling, incomplete capture), and everything it left in trains.

TRL drops a whole sample whose `model_version` is more than `max_staleness` versions behind the
trainer. A long rollout spans many versions, so `model_version` is the NEWEST version among the
trained tokens: TRL then drops only samples with no fresh token left, and staleness is handled
per token by the rollout source (trainer_bridge/outstanding.py), which masks the stale ones.
"""

import enum
from collections.abc import Iterable
from typing import Protocol

import numpy as np
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

# The trained-token count of the sample's whole rollout, carried in `RolloutSample.metrics`
# (the only free-form field that reaches TRL's collator) for rollout-level loss normalisation.
# The collator also logs it, as the per-sample mean rollout size.
ROLLOUT_TOKENS_METRIC = "sample/rollout_trained_tokens"


class MergedSequence(Protocol):
    """What this module reads of a merged sequence: per-token arrays of one length."""

    input_ids: np.ndarray  # int32 token ids
    loss_mask: np.ndarray  # nonzero on sampled (trained) tokens
    logprobs: np.ndarray  # float32, the sampled token's log-probability at its own index
    versions: np.ndarray  # int32 policy version of each sampled token, -1 on context


class Skip(enum.StrEnum):
    TOO_LONG = "too_long"  # longer than the trainer's token budget; never truncated
    NO_TRAINED_TOKENS = "no_trained_tokens"


def trained_mask(seq: MergedSequence) -> np.ndarray:
    """Boolean mask of the tokens the trainer can train on.

    The trainer scores token `i` from the hidden state at `i - 1`, so a first token is never
    trained; it is left out here so that token counts agree with the loss terms TRL builds.
    """
    mask = np.asarray(seq.loss_mask) != 0
    mask[:1] = False
    return mask


def skip_reason(seq: MergedSequence, max_tokens: int) -> Skip | None:
    """Why `seq` cannot be trained on, or None if it can."""
    if len(seq.input_ids) > max_tokens:
        return Skip.TOO_LONG
    if not trained_mask(seq).any():
        return Skip.NO_TRAINED_TOKENS
    return None


def to_rollout_sample(
    seq: MergedSequence,
    *,
    advantage: float,
    group_id: int,
    rollout_trained_tokens: int,
    reward: float | None = None,
    prompt: str | None = None,
    completion: str | None = None,
) -> RolloutSample:
    """Convert one trainable sequence (`skip_reason` is None) of a rollout.

    `rollout_trained_tokens` counts the trained tokens of all the rollout's kept sequences.
    `prompt` and `completion` are text for TRL's logs only; an unscorable `reward` is logged NaN.
    """
    n = len(seq.input_ids)
    if not (len(seq.loss_mask) == len(seq.logprobs) == len(seq.versions) == n):
        raise ValueError("input_ids, loss_mask, logprobs and versions must have one length")
    trained = trained_mask(seq)
    trained_versions = np.asarray(seq.versions)[trained]
    if not trained_versions.size:
        raise ValueError("a sequence without trained tokens is skipped, not converted")
    if trained_versions.min() < 0:
        raise ValueError("a trained token has no policy version")
    return RolloutSample(
        prompt=[{"role": "user", "content": prompt}] if prompt is not None else [],
        completion=[{"role": "assistant", "content": completion}] if completion is not None else [],
        input_ids=np.asarray(seq.input_ids, dtype=np.int64),
        completion_mask=trained.astype(np.int64),
        old_log_probs=np.where(trained, seq.logprobs, 0.0).astype(np.float32),
        advantage=float(advantage),
        model_version=int(trained_versions.max()),
        group_id=int(group_id),
        metrics={
            "reward": float("nan") if reward is None else float(reward),
            ROLLOUT_TOKENS_METRIC: float(rollout_trained_tokens),
        },
    )


def rollout_samples(
    sequences: Iterable[MergedSequence],
    *,
    advantage: float,
    group_id: int,
    max_tokens: int,
    reward: float | None = None,
    prompt: str | None = None,
    completion: str | None = None,
) -> tuple[list[RolloutSample], list[Skip | None]]:
    """The samples of one rollout's sequences, all with the rollout's advantage, and per
    sequence why it was skipped (None for each one that became a sample, in order)."""
    sequences = list(sequences)
    reasons = [skip_reason(seq, max_tokens) for seq in sequences]
    kept = [seq for seq, reason in zip(sequences, reasons, strict=True) if reason is None]
    total = sum(int(trained_mask(seq).sum()) for seq in kept)
    samples = [
        to_rollout_sample(
            seq,
            advantage=advantage,
            group_id=group_id,
            rollout_trained_tokens=total,
            reward=reward,
            prompt=prompt,
            completion=completion,
        )
        for seq in kept
    ]
    return samples, reasons
