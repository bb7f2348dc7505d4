"""The batcher's dry run (`FlushingBatcher.micro_batches`) counts the micro-batches its own
iteration makes, and a finite run takes only samples its remaining micro-batches train
(`OpenBatch.takes`, issue #40)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any, cast

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from trainer_bridge.handover import Fit, FlushingBatcher, OpenBatch, Placed

BUDGET = 64


@st.composite
def sample_streams(draw) -> list[Placed]:
    """Groups of samples sharing a prompt, in arrival order; some over the budget."""
    samples = []
    for group in range(draw(st.integers(0, 8))):
        prompt = draw(st.lists(st.integers(0, 50), min_size=1, max_size=40))
        for _ in range(draw(st.integers(1, 4))):
            reply = draw(st.lists(st.integers(0, 50), min_size=1, max_size=40))
            samples.append({"input_ids": np.array(prompt + reply),
                            "completion_mask": np.r_[np.zeros(len(prompt), int),
                                                     np.ones(len(reply), int)],
                            "group_id": group})
    return samples


class _Sample:
    """The fields of TRL's RolloutSample that the dry run reads."""

    def __init__(self, sample: Placed) -> None:
        self.input_ids = sample["input_ids"]
        self.completion_mask = sample["completion_mask"]
        self.group_id = sample["group_id"]


def batcher(samples: list[Placed], rows: int, open_batch: OpenBatch) -> FlushingBatcher:
    # The batcher reads its dataset only by iterating it: a list of sample dicts will do.
    return FlushingBatcher(cast(Any, samples), rows, BUDGET, defaultdict(list), open_batch)


def iterate(samples: list[Placed], rows: int, open_batch: OpenBatch) -> list[list[Placed]]:
    """The micro-batches the iteration emits over `samples`, then the open one, as samples."""
    emitted = [[s for row in batch for s in row.samples]
               for batch in batcher(samples, rows, open_batch)]
    held = [s for row in open_batch.rows for s in row]
    return emitted + ([held] if held else [])


@given(sample_streams(), st.integers(1, 3))
def test_the_dry_run_counts_the_micro_batches_the_iteration_makes(samples, rows):
    dry = batcher([], rows, OpenBatch(60)).micro_batches([], samples)
    assert dry == len(iterate(samples, rows, OpenBatch(60)))


@given(sample_streams(), st.integers(1, 3), st.integers(0, 40))
def test_the_dry_run_goes_on_from_the_open_rows(samples, rows, cut):
    """Counted from a half-filled micro-batch (what the feeder sees mid-run), the count is the
    same as from the start, less the micro-batches already emitted."""
    open_batch = OpenBatch(60)
    done = len([b for b in batcher(samples[:cut], rows, open_batch)])
    rest = open_batch.planner(open_batch.rows, samples[cut:])
    assert done + rest == batcher([], rows, OpenBatch(60)).micro_batches([], samples)


def _groups(samples: list[Placed]) -> list[list[Placed]]:
    groups: dict[int, list[Placed]] = defaultdict(list)
    for sample in samples:
        groups[sample["group_id"]].append(sample)
    return list(groups.values())


def _fit(open_batch: OpenBatch, queued: list[Placed], group: list[Placed]) -> Fit:
    return open_batch.fit(cast(Any, [_Sample(s) for s in queued]),
                          cast(Any, [_Sample(s) for s in group]))


@given(sample_streams(), st.integers(1, 3), st.integers(0, 6))
def test_a_finite_run_takes_whole_only_groups_its_micro_batches_train(samples, rows, left):
    """Groups offered in turn, as the feeder offers them: those that fit whole, taken before
    the first that does not, all train within `left` micro-batches."""
    open_batch = OpenBatch(60)
    batcher([], rows, open_batch)  # lends its dry run
    open_batch.micro_batches_left = left
    taken: list[Placed] = []
    for group in _groups(samples):
        if _fit(open_batch, taken, group) is not Fit.WHOLE:
            break
        taken += group
    made = iterate(taken, rows, OpenBatch(60))
    assert len(made) <= left
    assert sum(map(len, made)) == sum(len(s["input_ids"]) <= BUDGET for s in taken)


@given(sample_streams(), st.integers(1, 3), st.integers(0, 3))
def test_a_group_that_does_not_fit_waits_unless_the_trainer_is_idle(samples, rows, left):
    """A group that does not fit whole waits while anything is held or queued before it; to an
    idle trainer with micro-batches left it goes in part, and needs more than are left."""
    open_batch = OpenBatch(60)
    planner = batcher([], rows, open_batch).micro_batches
    open_batch.micro_batches_left = left
    groups = _groups(samples)
    for before, group in zip([[], *groups], groups, strict=False):
        fit = _fit(open_batch, before, group)
        needed = planner([], [*before, *group])
        assert (fit is Fit.WHOLE) == (needed <= left)
        if fit is not Fit.WHOLE:
            assert fit is (Fit.PART if not before and left > 0 else Fit.LATER)


@given(sample_streams(), st.integers(1, 3), st.integers(1, 4))
def test_the_iteration_ends_after_the_runs_last_micro_batch(samples, rows, left):
    open_batch = OpenBatch(60)
    open_batch.micro_batches_left = left
    emitted = list(batcher(samples, rows, open_batch))
    assert len(emitted) <= left
    assert open_batch.micro_batches_left == left - len(emitted)
