"""The bridge's release policy (trainer_bridge/release.py, pure): when a group is released, the
samples it becomes, and the staleness mask. No hypothesis deadlines: the examples are quick, but a
loaded machine is not."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.sequences import Seq
from trainer_bridge.advantages import group_advantages
from trainer_bridge.release import (
    Member,
    Release,
    SourceConfig,
    build_group,
    decide,
    group_number,
    mask_stale,
    plan_release,
)
from trainer_bridge.samples import ROLLOUT_TOKENS_METRIC


@settings(deadline=None)
@given(
    ready=st.integers(0, 20),
    waited=st.floats(0, 1000),
    released=st.booleans(),
    g=st.integers(1, 10),
    deadline=st.floats(0, 500),
    partial=st.sampled_from(["train", "drop"]),
)
def test_release_decision(ready, waited, released, g, deadline, partial):
    config = SourceConfig("", num_generations=g, token_budget=1, group_deadline_s=deadline,
                          partial_groups=partial)
    decision = decide(ready, waited, released, config)
    if released:
        assert decision is Release.REDELIVER
    elif ready >= g:
        assert decision is Release.COMPLETE
    elif waited < deadline:
        assert decision is Release.WAIT
    else:
        assert decision is (Release.PARTIAL if partial == "train" else Release.EXPIRED)
    assert decision.trains == (decision in (Release.COMPLETE, Release.PARTIAL,
                                            Release.REDELIVER))


@settings(deadline=None)
@given(st.text(max_size=80), st.text(max_size=80))
def test_group_number_is_stable_and_fits_62_bits(a, b):
    assert group_number(a) == group_number(a)
    assert 0 <= group_number(a) < 2**62
    if a != b:
        assert group_number(a) != group_number(b)  # 62-bit collisions: not in this lifetime


@st.composite
def rollout(draw):
    """A claimed rollout (reward, merge stats) and its merged sequences."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    seqs = []
    for _ in range(draw(st.integers(0, 3))):
        n = int(rng.integers(3, 40))
        mask = np.zeros(n, np.uint8)
        mask[int(rng.integers(1, n - 1)):] = 1
        seqs.append(Seq(rng.integers(0, 2048, n).astype(np.int32), mask,
                        np.where(mask, -rng.random(n), 0).astype(np.float32),
                        np.where(mask, rng.integers(10, 16), -1).astype(np.int32)))
    member = Member(
        id=uuid.uuid4(),
        reward=draw(st.one_of(st.none(), st.floats(-5, 5))),
        merge_stats={"calls": draw(st.integers(1, 6)),
                     "causes": {"drift": draw(st.integers(0, 3))}},
    )
    return member, seqs


@settings(deadline=None)
@given(st.lists(rollout(), min_size=1, max_size=6))
def test_group_samples_share_their_rollouts_advantage(rollouts):
    members = [m for m, _ in rollouts]
    traces = {m.id: list(enumerate(seqs)) for m, seqs in rollouts}
    config = SourceConfig("", num_generations=4, token_budget=30, version_offset=10)
    advantages, dropped = plan_release(members, Release.COMPLETE, config)
    assert dropped == []
    batch = build_group(members, advantages, traces, group_id=7, config=config)
    expected_adv = group_advantages([m.reward for m in members])
    expected, skipped = [], []
    for member, advantage in zip(members, expected_adv):
        for idx, seq in traces[member.id]:
            if len(seq.input_ids) > 30:
                # Put aside with the tokens it would have trained (its first one never trains).
                skipped.append((member.id, idx, "too_long", 0,
                                int(seq.loss_mask[1:].astype(bool).sum())))
                continue
            version = int(seq.versions[seq.loss_mask.astype(bool)].max()) - 10
            expected.append((advantage, version, member.reward, member.id, idx))
    got = [(s.advantage, s.model_version, s.metrics["reward"]) for s in batch.samples]
    assert len(got) == len(expected) == len(batch.pending)
    for (adv, version, reward, rid, idx), g, out in zip(expected, got, batch.pending):
        assert g[0] == pytest.approx(adv) and g[1] == version
        assert g[2] == reward or (reward is None and np.isnan(g[2]))
        assert (out.rollout_id, out.idx) == (rid, idx)
    assert batch.skipped == skipped
    assert all(s.group_id == 7 for s in batch.samples)
    # One trained-token count per rollout, whatever its sequences (rollout-level loss weights).
    assert all(s.metrics[ROLLOUT_TOKENS_METRIC] > 0 for s in batch.samples)
    assert batch.counts["rollouts"] == len(members)
    assert batch.counts["samples"] + batch.counts["too_long"] == sum(
        len(seqs) for _, seqs in rollouts)
    assert batch.metrics["rollout/group_size"] == len(members)
    assert batch.metrics["rollout/drift_rate"] == (
        sum(m.merge_stats["causes"]["drift"] for m in members),
        sum(m.merge_stats["calls"] - 1 for m in members))
    scored = [m.reward for m in members if m.reward is not None]
    if scored:
        assert batch.metrics["rollout/reward_mean"] == pytest.approx(np.mean(scored))


def test_a_released_group_keeps_its_advantages_and_its_newcomers_are_late():
    then = datetime.now(UTC)
    old = [Member(id=uuid.uuid4(), reward=r, released_at=then, advantage=a)
           for r, a in ((1.0, 0.7), (0.0, -0.7))]
    new = Member(id=uuid.uuid4(), reward=1.0)
    config = SourceConfig("", num_generations=2, token_budget=30)
    # Whatever a stale look at the group decided, the stored release wins.
    for decision in (Release.COMPLETE, Release.REDELIVER, Release.EXPIRED):
        advantages, dropped = plan_release([*old, new], decision, config)
        assert advantages == {old[0].id: 0.7, old[1].id: -0.7}
        assert dropped == [new.id]
    advantages, dropped = plan_release([new], Release.EXPIRED, config)
    assert advantages == {} and dropped == [new.id]


def test_a_rollout_trains_by_its_trace_mask_so_flagged_calls_stay_out():
    """The merge zeroes the loss mask over calls it flagged (constrained sampling, incomplete
    capture); the other calls of the same sequence train."""
    mask = np.array([0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1], np.uint8)  # call 2's reply: zeroed
    flagged = np.zeros(12, bool)
    flagged[7:10] = True  # what call 2 sampled
    seq = Seq(np.arange(12, dtype=np.int32), mask,
              np.where(mask | flagged, -0.5, 0).astype(np.float32),
              np.where(mask | flagged, 3, -1).astype(np.int32))
    member = Member(id=uuid.uuid4(), reward=1.0, merge_stats={})
    config = SourceConfig("", num_generations=1, token_budget=64)
    batch = build_group([member], {member.id: 1.0}, {member.id: [(0, seq)]}, group_id=1,
                        config=config)
    [sample] = batch.samples
    np.testing.assert_array_equal(sample.completion_mask, mask)
    assert not sample.completion_mask[flagged].any()
    assert np.all(sample.old_log_probs[flagged] == 0)


@settings(deadline=None)
@given(st.integers(0, 8), st.integers(0, 30), st.data())
def test_stale_tokens_are_masked_and_fresh_ones_kept(max_staleness, trainer_version, data):
    versions = np.array(data.draw(st.lists(st.integers(-1, 30), min_size=1, max_size=40)))
    mask = (versions >= 0).astype(np.int64)
    keep = mask_stale(mask, versions, trainer_version, max_staleness)
    for m, v, k in zip(mask, versions, keep):
        assert k == (bool(m) and trainer_version - v <= max_staleness)
