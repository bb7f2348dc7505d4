import asyncio
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from trainer_bridge.advantages import group_advantages, rollout_loss_weights

reward = st.floats(-100, 100, allow_nan=False)
group = st.lists(st.one_of(st.none(), reward), min_size=1, max_size=16)


def scorable(rewards):
    return np.array([r is not None for r in rewards])


@given(group, st.booleans())
def test_mean_zero_over_scorable_and_zero_for_unscorable(rewards, scale_std):
    adv = group_advantages(rewards, scale_std=scale_std)
    mask = scorable(rewards)
    assert adv.shape == (len(rewards),)
    assert np.all(adv[~mask] == 0.0)
    if mask.any():
        assert abs(adv[mask].sum()) < 1e-6 * max(1.0, np.abs(adv).max()) * len(rewards)


@given(group)
def test_unit_population_std_when_rewards_spread(rewards):
    values = np.array([r for r in rewards if r is not None])
    assume(len(values) >= 2 and values.std() > 1e-3)
    adv = group_advantages(rewards)[scorable(rewards)]
    assert adv.std() == pytest.approx(1.0, rel=1e-4)
    np.testing.assert_allclose(
        group_advantages(rewards, scale_std=False)[scorable(rewards)],
        values - values.mean(),
        atol=1e-9,
    )


@given(reward, st.integers(0, 5), st.booleans())
def test_single_scorable_member_gets_zero(r, n_unscorable, scale_std):
    adv = group_advantages([None] * n_unscorable + [r], scale_std=scale_std)
    assert np.all(adv == 0.0)


@given(reward, st.integers(1, 10), st.booleans())
def test_all_equal_rewards_give_zero(r, n, scale_std):
    assert np.all(group_advantages([r] * n, scale_std=scale_std) == 0.0)


@given(st.integers(1, 8))
def test_all_unscorable_gives_zero(n):
    assert np.all(group_advantages([None] * n) == 0.0)


@given(group, st.floats(-50, 50), st.floats(0.1, 10))
def test_invariant_to_affine_reward_shift(rewards, shift, scale):
    values = np.array([r for r in rewards if r is not None])
    # eps (1e-8) is the only thing that breaks the invariance: keep it far below both stds.
    assume(len(values) >= 2 and values.std() > 1e-2 and scale * values.std() > 1e-2)
    moved = [None if r is None else scale * r + shift for r in rewards]
    np.testing.assert_allclose(
        group_advantages(moved), group_advantages(rewards), rtol=1e-5, atol=1e-7
    )
    shifted = [None if r is None else r + shift for r in rewards]
    np.testing.assert_allclose(
        group_advantages(shifted, scale_std=False),
        group_advantages(rewards, scale_std=False),
        atol=1e-6,
    )


def _trl_advantages(rewards: list[float | None]) -> list[float]:
    """The advantages TRL's built-in async rollout worker gives one group with these rewards:
    its own `_score_group`, run on a group whose reward function returns them."""
    from accelerate import PartialState
    from trl.experimental.async_grpo.async_rollout_worker import RolloutGroup, _AsyncRolloutLoop

    PartialState()  # TRL's logger needs it, as in the worker's own process

    def given_rewards(**_):
        return list(rewards)

    # Only the scoring half of the worker is needed: no model server, no dataset.
    loop = object.__new__(_AsyncRolloutLoop)
    loop.reward_funcs, loop.reward_func_names = [given_rewards], ["given"]
    loop._env_reward_types = []
    n = len(rewards)
    sequence = SimpleNamespace(input_ids=[1, 2], completion_mask=[0, 1], old_log_probs=[0, -1])
    group = RolloutGroup(
        prompts=[[]] * n, reward_kwargs={}, completions=[[]] * n, completions_ids=[[2]] * n,
        completions_sequences=[[sequence]] * n, tool_call_counts=[0] * n,
        tool_failure_counts=[0] * n, model_version=0, group_id=0, env_rewards=[None] * n,
        rollout_rewards=[None] * n,
    )
    samples = asyncio.run(loop._score_group(group))
    return [s.advantage for s in samples]


@settings(deadline=None)  # the first example imports TRL
@given(group)
def test_matches_trl_builtin_worker(rewards):
    # TRL scores in float32: where a group's spread is near float32 rounding of its rewards
    # (all equal, say), TRL's numbers are rounding noise divided by a noise-sized std.
    scorable = np.array([r for r in rewards if r is not None])
    if len(scorable) >= 2:
        assume(np.ptp(scorable) > 1e-2 * max(1.0, np.abs(scorable).max()))
    expected = _trl_advantages(rewards)
    np.testing.assert_allclose(group_advantages(rewards), expected, rtol=1e-4, atol=1e-5)


@given(st.lists(st.lists(st.integers(1, 50), min_size=1, max_size=5), min_size=1, max_size=8))
def test_every_rollout_weighs_the_same_whatever_its_sequences(rollouts):
    """`rollouts[r]` lists the trained-token counts of rollout r's sequences."""
    totals = [sum(seqs) for seqs in rollouts]
    owner = np.concatenate([np.full(sum(seqs), r) for r, seqs in enumerate(rollouts)])
    weights = rollout_loss_weights(np.array(totals)[owner])
    assert np.all(weights > 0)
    assert weights.sum() == pytest.approx(1.0)
    per_rollout = np.bincount(owner, weights=weights)
    np.testing.assert_allclose(per_rollout, 1 / len(rollouts), rtol=1e-9)
    np.testing.assert_allclose(weights, 1 / (len(rollouts) * np.array(totals)[owner]), rtol=1e-9)


@given(st.lists(st.integers(2, 40), min_size=1, max_size=6), st.data())
def test_a_rollout_split_across_batches_keeps_its_share(totals, data):
    """Only part of each rollout's tokens in this batch: each rollout weighs its part's share."""
    present = [data.draw(st.integers(1, t)) for t in totals]
    owner = np.concatenate([np.full(p, r) for r, p in enumerate(present)])
    weights = rollout_loss_weights(np.array(totals)[owner])
    shares = np.array(present) / np.array(totals)
    np.testing.assert_allclose(
        np.bincount(owner, weights=weights), shares / shares.sum(), rtol=1e-9
    )


def test_rejects_empty_rollouts():
    with pytest.raises(ValueError):
        rollout_loss_weights(np.array([3, 0]))
