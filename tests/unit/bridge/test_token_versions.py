"""Per-token policy versions reach the trainer lined up with TRL's loss terms, and the
sampler/trainer agreement is also taken over the tokens the trainer's current weights sampled
(trainer_bridge/collators.py: `VersionCollator`; trainer_bridge/trainer.py: `Agreement`)."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from trl.experimental.async_grpo.async_grpo_trainer import DataCollatorForRollout
from trl.experimental.async_grpo.packing import TreeRow

from trainer_bridge.collators import VersionCollator
from trainer_bridge.trainer import Agreement
from trainer_bridge.worker import VERSIONS_KEY


@st.composite
def rows(draw):
    """1-2 rows of groups whose members share a prompt (TRL's packer forwards it once), each
    token's version a value unique to (row, sample, position), carried as its old log-prob too:
    a loss term's version must then equal its old log-prob, whatever order the packer uses."""
    out, value = [], 0
    for _ in range(draw(st.integers(1, 2))):
        samples = []
        for _ in range(draw(st.integers(1, 3))):  # groups
            prompt = draw(st.lists(st.integers(0, 50), min_size=1, max_size=6))
            for _ in range(draw(st.integers(1, 4))):  # members
                reply = draw(st.lists(st.integers(0, 50), min_size=1, max_size=8))
                n = len(prompt) + len(reply)
                mask = np.r_[np.zeros(len(prompt), np.int64),
                             draw(st.lists(st.integers(0, 1), min_size=len(reply),
                                           max_size=len(reply)))]
                versions = np.arange(value, value + n, dtype=np.int64)
                value += n
                samples.append({"input_ids": np.asarray(prompt + reply, np.int64),
                                "completion_mask": mask,
                                "old_log_probs": versions.astype(np.float32),
                                "advantage": 1.0, "group_id": len(samples),
                                "metrics": {VERSIONS_KEY: versions, "reward": 1.0}})
        out.append(samples)
    return out


def collate(samples_by_row):
    packed = []
    for samples in samples_by_row:
        row = TreeRow()
        for sample in samples:
            row.add(sample)
        packed.append(row)
    sink: defaultdict[str, list] = defaultdict(list)
    batch = VersionCollator(DataCollatorForRollout(0, len(packed), metrics=sink))([packed])
    return batch, sink


@settings(max_examples=150, deadline=None)
@given(rows())
def test_each_loss_term_gets_the_version_of_the_token_it_trains(samples_by_row):
    batch, sink = collate(samples_by_row)
    terms = batch["token_index"] >= 0
    assert batch["token_version"].shape == batch["token_index"].shape
    assert torch.equal(batch["token_version"][terms], batch["old_log_probs"][terms].long())
    assert (batch["token_version"][~terms] == -1).all()
    assert VERSIONS_KEY not in sink  # taken out before TRL logs the samples' metrics
    assert all(VERSIONS_KEY not in s["metrics"] for row in samples_by_row for s in row)


def test_a_micro_batch_with_a_sample_without_versions_gets_none():
    sample = {"input_ids": np.arange(4), "completion_mask": np.array([0, 1, 1, 1]),
              "old_log_probs": np.zeros(4, np.float32), "advantage": 1.0, "group_id": 0,
              "metrics": {}}
    batch, _ = collate([[sample]])
    assert "token_version" not in batch


def test_agreement_over_the_current_versions_tokens_leaves_the_stale_ones_out():
    trainer_lp = torch.tensor([-1.0, -2.0, -3.0, -4.0])
    recorded = torch.tensor([-1.0, -2.1, -1.0, -4.0])  # the stale third token: gap e^2
    versions = torch.tensor([3, 3, 1, 3])
    metrics: defaultdict[str, list] = defaultdict(list)
    model = Agreement(lambda **_: SimpleNamespace(log_probs=trainer_lp.clone()),
                       torch.arange(4), recorded, metrics, versions, current=3)
    model()
    (total, count), = metrics["agreement/exp_abs_dlogp"]
    assert total / count == pytest.approx((3 + np.exp(0.1) + np.exp(2.0) - 1) / 4, rel=1e-5)
    assert metrics["agreement/exp_abs_dlogp_max"] == [pytest.approx(np.exp(2.0), rel=1e-5)]
    (total, count), = metrics["agreement/same_version_exp_abs_dlogp"]
    assert (total, count) == (pytest.approx(2 + np.exp(0.1), rel=1e-5), 3.0)
    assert metrics["agreement/same_version_exp_abs_dlogp_max"] == [
        pytest.approx(np.exp(0.1), rel=1e-5)]
    assert metrics["agreement/same_version_frac"] == [(3, 4.0)]


def test_agreement_with_no_token_of_the_current_version_says_so_by_its_share():
    metrics: defaultdict[str, list] = defaultdict(list)
    Agreement(lambda **_: SimpleNamespace(log_probs=torch.zeros(2)), torch.arange(2),
               torch.zeros(2), metrics, torch.tensor([1, 1]), current=2)()
    assert metrics["agreement/same_version_frac"] == [(0, 2.0)]
    assert "agreement/same_version_exp_abs_dlogp" not in metrics
