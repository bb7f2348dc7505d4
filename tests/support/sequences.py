"""A merged sequence with only the fields the trainer bridge reads, for building test data."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["Seq"]


@dataclass
class Seq:
    input_ids: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    call_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
