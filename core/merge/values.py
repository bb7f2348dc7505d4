"""The merge's values: a recorded call's tokens as the merge reads them, its options, and what it
returns (the sequences, their statistics), with the names of its causes."""

from __future__ import annotations

from typing import Any, Literal

import msgspec
import numpy as np

CAUSES = ("drift", "rewrite", "independent", "abandoned")
STATUSES = ("ok", "aborted", "failed")
SIDE_CALLS = ("auto", "toolless", "none")
SideCalls = Literal["auto", "toolless", "none"]
# Why a sampled token is not trained, in the order a call's reason is picked: the merge's own
# causes here, the trainer bridge adds its own (core/store/ledger.py).
EXCLUSION_CAUSES = ("incomplete", "aborted", "abandoned", "constrained", "auxiliary")
# The setting that trains tokens excluded for each cause, for messages that say what to do.
EXCLUSION_FLAGS = {
    "incomplete": "none: the engine's record of these tokens is incomplete",
    "aborted": "the gateway's --train-aborted",
    "abandoned": "the gateway's --train-abandoned",
    "constrained": "the gateway's --train-constrained",
    "auxiliary": "the gateway's --train-auxiliary, or side_calls none on POST /admin/rollouts",
}


class CallTokens(msgspec.Struct, frozen=True, eq=False):
    """One recorded model call, as the engine saw and sampled it.

    A Struct like every record type of the project; numpy fields are fine because a Struct does not
    validate on construction, and __post_init__ normalises them (lists or other widths from the
    store) to the dtypes the merge relies on.
    """

    id: str
    seq: int
    prompt_ids: np.ndarray
    completion_ids: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    status: str
    offered_tools: bool
    # Sampled under a grammar or banned/forced tokens: not the free policy's logprobs.
    constrained: bool = False
    # Stored tokens that cannot be trained at all (e.g. logprobs that do not line up): the
    # call is context for its successors and never trained, whatever the options.
    context_only: bool = False
    # Retry evidence: the request body's digest, the SDK's retry count, and when the call
    # started (seconds, any epoch) to order attempts.
    digest: bytes | None = None
    retry_count: int = 0
    started: float = 0.0

    def __post_init__(self) -> None:
        for name, dtype in (
            ("prompt_ids", np.int32),
            ("completion_ids", np.int32),
            ("logprobs", np.float32),
            ("versions", np.int32),
        ):
            array = np.ascontiguousarray(getattr(self, name), dtype=dtype)
            if array.ndim != 1:
                raise ValueError(f"call {self.id}: {name} must be one-dimensional")
            msgspec.structs.force_setattr(self, name, array)
        sampled = self.completion_ids.size
        if self.logprobs.size != sampled or self.versions.size != sampled:
            raise ValueError(
                f"call {self.id}: {sampled} completion ids but {self.logprobs.size} logprobs "
                f"and {self.versions.size} versions"
            )
        if self.status not in STATUSES:
            raise ValueError(f"call {self.id}: status {self.status!r} not in {STATUSES}")


class MergeOptions(msgspec.Struct, frozen=True, kw_only=True):
    train_constrained: bool = False
    train_auxiliary: bool = False
    train_abandoned: bool = False
    train_aborted: bool = False
    # Which toolless calls are side calls (see the module doc); set per rollout by its creator.
    side_calls: SideCalls = "auto"

    def __post_init__(self) -> None:
        if self.side_calls not in SIDE_CALLS:
            raise ValueError(f"side_calls must be one of {SIDE_CALLS}, not {self.side_calls!r}")


class MergedSequence(msgspec.Struct, frozen=True, eq=False):
    input_ids: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    call_ids: list[str]
    cause: str
    auxiliary: bool
    excluded: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "input_ids": self.input_ids.tolist(),
            "loss_mask": self.loss_mask.tolist(),
            "logprobs": self.logprobs.tolist(),
            "versions": self.versions.tolist(),
            "call_ids": list(self.call_ids),
            "cause": self.cause,
            "auxiliary": self.auxiliary,
            "excluded": self.excluded,
        }


class MergeStats(msgspec.Struct, frozen=True):
    calls: int
    sequences: int
    trained_tokens: int
    sampled_tokens: int
    lost_tokens: int
    excluded_tokens: int
    causes: dict[str, int]
    excluded_sequences: int
    auxiliary_sequences: int
    constrained_calls: int = 0
    constrained_tokens: int = 0  # sampled under constraints, not trained unless configured
    retried_calls: int = 0  # earlier attempts of a retried request, marked abandoned
    context_only_calls: int = 0  # calls whose tokens could not be trained at all
    # Sampled tokens not trained, by the first reason (EXCLUSION_CAUSES) that keeps each call out.
    excluded_by_cause: dict[str, int] = {}


class MergeResult(msgspec.Struct, frozen=True, eq=False):
    sequences: list[MergedSequence]
    stats: MergeStats
    parents: dict[str, str | None]
    options: MergeOptions
    abandoned: list[str] = []  # calls marked abandoned (retried, or a dropped retry sibling)

    def to_dict(self) -> dict[str, Any]:
        return {
            "sequences": [s.to_dict() for s in self.sequences],
            "stats": msgspec.structs.asdict(self.stats),
            "parents": dict(self.parents),
            "options": msgspec.structs.asdict(self.options),
        }
