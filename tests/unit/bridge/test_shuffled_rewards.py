"""The bridge's shuffled-reward control (`--shuffle-rewards`): rewards are permuted within a
group before the advantages, the same way every time the group is released."""

from __future__ import annotations

import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainer_bridge.advantages import group_advantages
from trainer_bridge.release import Member, Release, SourceConfig, plan_release


def _members(rewards):
    return [Member(id=uuid.UUID(int=i + 1), reward=r) for i, r in enumerate(rewards)]


@given(st.lists(st.sampled_from([0.0, 0.25, 1.0, None]), min_size=2, max_size=8))
def test_shuffled_advantages_are_a_fixed_permutation_of_the_true_ones(rewards):
    members = _members(rewards)
    shuffled = SourceConfig("", num_generations=8, token_budget=100, shuffle_rewards=True)
    first, dropped = plan_release(members, Release.COMPLETE, shuffled)
    again, _ = plan_release(list(reversed(members)), Release.COMPLETE, shuffled)
    assert dropped == [] and first == again
    true = group_advantages(rewards)
    # The same values up to rounding (the advantage arithmetic depends on the order).
    assert sorted(first.values()) == pytest.approx(sorted(float(a) for a in true), abs=1e-6)


def test_a_shuffled_group_can_reward_what_failed():
    members = _members([1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    plain = SourceConfig("", num_generations=8, token_budget=100)
    shuffled = SourceConfig("", num_generations=8, token_budget=100, shuffle_rewards=True)
    assert max(plan_release(members, Release.COMPLETE, plain)[0].items(),
               key=lambda kv: kv[1])[0] == members[0].id
    # Some permutation of 8 moves the one success; this group's does (fixed by its ids).
    best = max(plan_release(members, Release.COMPLETE, shuffled)[0].items(),
               key=lambda kv: kv[1])[0]
    assert best != members[0].id
