"""Collators around TRL's packer (`DataCollatorForRollout`): what rolltap's samples carry in
their metrics (the one free-form field that reaches the collator) moves into the batch, out of
TRL's logged metrics.

- `RolloutWeightCollator`: per loss term, its rollout-level weight (`loss_normalization=rollout`).
- `DeliveryCollator`: the rollout source's sample numbers (`delivery_ids`), and the micro-batch's
  metrics held until the step that trains it (`HeldMetrics`).
- `VersionCollator`: each loss term's policy version (`token_version`), for the agreement over
  the tokens the trainer's current weights sampled.
"""

from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from trl.experimental.async_grpo.async_grpo_trainer import DataCollatorForRollout

from trainer_bridge.advantages import rollout_loss_weights
from trainer_bridge.samples import ROLLOUT_TOKENS_METRIC
from trainer_bridge.worker import DELIVERY_KEY, VERSIONS_KEY


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


class HeldMetrics:
    """TRL's collator's metric sink (rewards, packing), each micro-batch's held from its
    collation until a step trains it. Accelerate's dispatcher collates one micro-batch ahead,
    so written straight into the trainer's metrics they would be logged with the step before
    the one that trains them, and a run's last step would log none."""

    def __init__(self) -> None:
        self.sink: defaultdict[str, list] = defaultdict(list)  # what the collator appends to
        self._held: deque[dict[str, list]] = deque()

    def seal(self) -> None:
        """The micro-batch just collated is complete: hold its metrics."""
        self._held.append(dict(self.sink))
        self.sink.clear()

    def release(self, into: dict[str, list]) -> None:
        """A step trains the oldest micro-batch held: its metrics go `into` the step's."""
        if self._held:
            for key, values in self._held.popleft().items():
                into[key].extend(values)


@dataclass
class DeliveryCollator:
    """Moves the rollout source's sample numbers out of the samples' metrics (where TRL would log
    them) into `delivery_ids`: every number of the micro-batch, repeated per rank like TRL's own
    batch-wide values, so the main process sees them all whatever row it trains. With `held`,
    the micro-batch's metrics wait for the step that trains it."""

    inner: Any
    held: HeldMetrics | None = field(default=None)

    def __call__(self, examples: list[Any]) -> dict[str, Any]:
        (rows,) = examples
        numbers = [
            int(number)
            for row in rows
            for sample in row.samples
            if (number := sample["metrics"].pop(DELIVERY_KEY, None)) is not None
        ]
        batch = self.inner(examples)
        if self.held is not None:
            self.held.seal()
        if numbers:
            batch["delivery_ids"] = torch.tensor([numbers] * len(rows), dtype=torch.int64)
        return batch


def loss_term_versions(samples: list[dict[str, Any]], versions: list[np.ndarray]) -> np.ndarray:
    """The policy version of each of a row's loss terms, in the order TRL's packer lays them
    out (`TreeRow.pack`: sample by sample, each trained position after the first)."""
    parts = [np.asarray(v, dtype=np.int64)[1:][np.asarray(s["completion_mask"])[1:] != 0]
             for s, v in zip(samples, versions, strict=True)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


@dataclass
class VersionCollator:
    """Moves each sample's per-token policy versions out of its metrics (where TRL would log
    them) into `token_version`, one per loss term and shaped like `token_index` (-1 on its
    padding), so the agreement metric can tell the tokens the trainer's current weights sampled.
    A micro-batch with a sample that carries no versions gets no `token_version`."""

    inner: Any

    def __call__(self, examples: list[Any]) -> dict[str, Any]:
        (rows,) = examples
        versions = [[sample["metrics"].pop(VERSIONS_KEY, None) for sample in row.samples]
                    for row in rows]
        batch = self.inner(examples)
        if any(v is None for row in versions for v in row):
            return batch
        terms = batch["token_index"] >= 0
        token_version = torch.full(terms.shape, -1, dtype=torch.int64)
        for r, row in enumerate(rows):
            per_term = loss_term_versions(row.samples, versions[r])
            if per_term.size != int(terms[r].sum()):
                raise ValueError(f"{per_term.size} token versions for {int(terms[r].sum())} loss "
                                 "terms: TRL's packer no longer lays terms out sample by sample")
            token_version[r, : per_term.size] = torch.from_numpy(per_term)
        batch["token_version"] = token_version
        return batch
