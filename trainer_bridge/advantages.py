"""Group-relative advantages and rollout-level loss weights (pure functions).

An advantage belongs to a rollout, not to a training sequence: every sequence a rollout was merged
into gets the rollout's advantage, so a rollout that forked into many sequences does not count
more in the group statistics.
"""

from collections.abc import Sequence

import numpy as np


def group_advantages(
    rewards: Sequence[float | None], scale_std: bool = True, eps: float = 1e-8
) -> np.ndarray:
    """Per-rollout advantages of one group: `(r - mean) / (std + eps)` over the scorable rollouts.

    `None` marks an unscorable rollout: it is left out of the mean and the (population) std and
    gets advantage 0, so it neither pushes nor pulls the policy. `scale_std=False` gives
    `r - mean`.
    """
    scored = np.array([r is not None for r in rewards], dtype=bool)
    values = np.array([r if r is not None else 0.0 for r in rewards], dtype=np.float64)
    advantages = np.zeros(len(values), dtype=np.float64)
    if scored.any():
        # Shifting by one member first makes a group of equal rewards centre to exact zeros
        # (a plain mean of equal floats can miss them by an ulp, which 1 / (0 + eps) amplifies).
        shifted = values[scored] - values[scored][0]
        centred = shifted - shifted.mean()
        advantages[scored] = centred / (shifted.std() + eps) if scale_std else centred
    return advantages


def rollout_loss_weights(rollout_tokens: np.ndarray) -> np.ndarray:
    """Per-token loss weights under which every rollout weighs the same, whatever its length.

    `rollout_tokens[t]` is the number of trained tokens of the rollout token `t` belongs to. A
    token's weight is proportional to `1 / rollout_tokens[t]`, normalised to sum to 1, which is
    `1 / (rollouts_in_batch * rollout_tokens[t])` when the batch holds whole rollouts. A rollout
    whose sequences are split across batches keeps, in each batch, the share its tokens there
    represent, instead of counting as a whole rollout in each.
    """
    tokens = np.asarray(rollout_tokens, dtype=np.float64)
    if (tokens <= 0).any():
        raise ValueError("a trained token's rollout must have at least one trained token")
    inverse = 1.0 / tokens
    return inverse / inverse.sum()
