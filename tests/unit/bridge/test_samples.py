import math
from collections import Counter

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample
from trl.experimental.async_grpo.packing import TreeRow

from tests.support.sequences import Seq
from trainer_bridge.samples import (
    ROLLOUT_TOKENS_METRIC,
    Skip,
    rollout_samples,
    skip_reason,
    to_rollout_sample,
)


@st.composite
def sequences(draw, min_len=1, max_len=60, trained=None):
    n = draw(st.integers(min_len, max_len))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if trained is None:
        mask = rng.random(n) < draw(st.floats(0, 1))
    else:
        mask = np.zeros(n, dtype=bool)
        mask[rng.choice(n, size=min(trained, n), replace=False)] = True
    versions = np.where(mask, rng.integers(0, 9, n), -1).astype(np.int32)
    # Context logprobs hold junk on purpose: the conversion must zero them.
    logprobs = -rng.random(n).astype(np.float32) * 5
    return Seq(
        input_ids=rng.integers(0, 2048, n).astype(np.int32),
        loss_mask=mask.astype(np.uint8),
        logprobs=logprobs,
        versions=versions,
        call_ids=np.zeros(n, dtype=np.int64),
    )


@given(sequences(min_len=2, trained=2), st.floats(-3, 3), st.integers(0, 10**6))
def test_arrays_as_the_trainer_reads_them(seq, advantage, group_id):
    sample = to_rollout_sample(
        seq, advantage=advantage, group_id=group_id, rollout_trained_tokens=7, reward=1.0
    )
    assert isinstance(sample, RolloutSample)
    n = len(seq.input_ids)
    assert sample.input_ids.dtype == np.int64 and sample.input_ids.shape == (n,)
    assert sample.completion_mask.dtype == np.int64 and sample.completion_mask.shape == (n,)
    assert sample.old_log_probs.dtype == np.float32 and sample.old_log_probs.shape == (n,)
    np.testing.assert_array_equal(sample.input_ids, seq.input_ids)
    trained = seq.loss_mask != 0
    trained[0] = False  # nothing precedes the first token, so it cannot be trained
    np.testing.assert_array_equal(sample.completion_mask, trained)
    np.testing.assert_array_equal(sample.old_log_probs[trained], seq.logprobs[trained])
    assert np.all(sample.old_log_probs[~trained] == 0.0)
    assert sample.advantage == advantage and sample.group_id == group_id
    assert sample.metrics == {"reward": 1.0, ROLLOUT_TOKENS_METRIC: 7.0}


@given(sequences(min_len=4, trained=3))
def test_model_version_is_the_newest_trained_token(seq):
    trained = seq.loss_mask != 0
    trained[0] = False
    seq.versions[~trained] = -1  # a first token's version, if any, must not count
    sample = to_rollout_sample(seq, advantage=0.0, group_id=0, rollout_trained_tokens=3)
    # TRL drops a sample whose model_version is stale: only one with no fresh token left.
    assert sample.model_version == seq.versions[trained].max()


def test_model_version_ignores_context_and_picks_the_straddling_maximum():
    seq = Seq(
        input_ids=np.arange(6, dtype=np.int32),
        loss_mask=np.array([0, 0, 1, 1, 0, 1], dtype=np.uint8),
        logprobs=np.full(6, -0.5, dtype=np.float32),
        # A response that straddled a weight sync: tokens of version 4 then 5; context is -1.
        versions=np.array([-1, -1, 4, 5, -1, 5], dtype=np.int32),
        call_ids=np.zeros(6, dtype=np.int64),
    )
    assert (
        to_rollout_sample(seq, advantage=1, group_id=0, rollout_trained_tokens=3).model_version == 5
    )


def test_a_trained_first_token_alone_is_nothing_to_train():
    seq = Seq(
        np.arange(3, dtype=np.int32),
        np.array([1, 0, 0], np.uint8),
        np.zeros(3, np.float32),
        np.array([0, -1, -1], np.int32),
        np.zeros(3, np.int64),
    )
    assert skip_reason(seq, max_tokens=10) is Skip.NO_TRAINED_TOKENS
    with pytest.raises(ValueError, match="skipped"):
        to_rollout_sample(seq, advantage=0, group_id=0, rollout_trained_tokens=1)


def test_trained_token_without_version_is_an_error():
    seq = Seq(
        np.arange(3, dtype=np.int32),
        np.array([0, 1, 1], np.uint8),
        np.zeros(3, np.float32),
        np.array([-1, 2, -1], np.int32),
        np.zeros(3, np.int64),
    )
    with pytest.raises(ValueError, match="policy version"):
        to_rollout_sample(seq, advantage=0, group_id=0, rollout_trained_tokens=2)


def test_mismatched_lengths_are_an_error():
    seq = Seq(
        np.arange(3, dtype=np.int32),
        np.array([0, 1], np.uint8),
        np.zeros(3, np.float32),
        np.zeros(3, np.int32),
        np.zeros(3, np.int64),
    )
    with pytest.raises(ValueError, match="one length"):
        to_rollout_sample(seq, advantage=0, group_id=0, rollout_trained_tokens=1)


def test_unscorable_reward_is_logged_nan_and_text_becomes_messages():
    seq = Seq(
        np.arange(3, dtype=np.int32),
        np.array([0, 1, 1], np.uint8),
        np.zeros(3, np.float32),
        np.array([-1, 0, 0], np.int32),
        np.zeros(3, np.int64),
    )
    sample = to_rollout_sample(
        seq,
        advantage=0,
        group_id=3,
        rollout_trained_tokens=2,
        reward=None,
        prompt="fix the bug",
        completion="done",
    )
    assert math.isnan(sample.metrics["reward"])
    assert sample.prompt == [{"role": "user", "content": "fix the bug"}]
    assert sample.completion == [{"role": "assistant", "content": "done"}]


@given(
    st.lists(sequences(max_len=40), min_size=1, max_size=6), st.integers(1, 40), st.floats(-2, 2)
)
def test_rollout_skips_and_counts_never_truncates(seqs, max_tokens, advantage):
    samples, reasons = rollout_samples(
        seqs, advantage=advantage, group_id=5, max_tokens=max_tokens, reward=0.5
    )
    assert reasons == [skip_reason(s, max_tokens) for s in seqs]
    skipped = Counter(reasons)
    too_long = [s for s in seqs if len(s.input_ids) > max_tokens]
    untrained = [s for s in seqs if len(s.input_ids) <= max_tokens and not s.loss_mask[1:].any()]
    kept = [s for s in seqs if skip_reason(s, max_tokens) is None]
    assert skipped[Skip.TOO_LONG] == len(too_long)
    assert skipped[Skip.NO_TRAINED_TOKENS] == len(untrained)
    assert len(samples) == len(kept) == len(seqs) - len(too_long) - len(untrained)
    total = sum(int(s.loss_mask[1:].astype(bool).sum()) for s in kept)
    for sample, seq in zip(samples, kept, strict=True):
        assert len(sample.input_ids) == len(seq.input_ids) <= max_tokens
        assert sample.advantage == pytest.approx(advantage)
        assert sample.metrics[ROLLOUT_TOKENS_METRIC] == total


@given(st.lists(sequences(min_len=3, trained=4), min_size=1, max_size=4))
def test_trl_packer_takes_each_trained_tokens_own_logprob(seqs):
    """The real TRL packer scores token p with old_log_probs[p]: check the alignment end to end."""
    samples, _ = rollout_samples(seqs, advantage=1.0, group_id=0, max_tokens=1000)
    row = TreeRow()
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
    packed = row.pack()
    for i, seq in enumerate(seqs):
        mask = seq.loss_mask.astype(bool)
        mask[0] = False
        assert samples[i].completion_mask.sum() == mask.sum()  # one loss term per trained token
        got = packed["old_log_probs"][packed["segment_id"] == i].numpy()
        np.testing.assert_array_equal(got, seq.logprobs[mask])
