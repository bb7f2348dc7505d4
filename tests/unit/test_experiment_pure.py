"""The learning experiment's pure parts: task generation (deterministic, valid task format,
splits disjoint, hidden tests consistent with the grader's cases) and the paired statistics on
known inputs and properties. Nothing here asserts that anything learns."""

from __future__ import annotations

import json
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandbox.tasks import load_tasks
from stack.experiment import stats
from stack.experiment.tasks import (
    generate,
    length_variant,
    prompts,
    read_tasks,
    reply_length_reward,
    write_tasks,
)
from stack.experiment.templates import ALL, IN_DISTRIBUTION, OUT_OF_DISTRIBUTION, draw


def test_at_least_ten_templates_and_some_never_trained():
    assert len(IN_DISTRIBUTION) >= 10
    assert OUT_OF_DISTRIBUTION and not set(OUT_OF_DISTRIBUTION) & set(IN_DISTRIBUTION)


@given(seed=st.integers(0, 10**6))
@settings(max_examples=20, deadline=None)
def test_generation_is_deterministic_from_the_seed(seed):
    assert generate(seed, "train", ALL, 2) == generate(seed, "train", ALL, 2)


def test_different_seeds_give_different_tasks():
    assert prompts(generate(1, "train", ALL, 2)) != prompts(generate(2, "train", ALL, 2))


def test_splits_share_no_prompt():
    heldout = generate(0, "heldout", IN_DISTRIBUTION, 5)
    train = generate(0, "train", IN_DISTRIBUTION, 40, exclude=prompts(heldout))
    assert not prompts(train) & prompts(heldout)
    assert len(train) == 40 * len(IN_DISTRIBUTION)


@given(template=st.sampled_from(sorted(ALL)), seed=st.integers(0, 10**6))
@settings(max_examples=60, deadline=None)
def test_instances_examples_and_cases_are_the_references(template, seed):
    inst = draw(template, random.Random(seed))
    (task,) = generate(seed, "x", [template], 1)
    assert task["metadata"]["template"] == template
    assert inst.func.isidentifier()
    for args, expected in task["metadata"]["cases"]:
        assert json.dumps(expected)  # the grader's cases survive a JSON round trip
        assert f"{expected!r}" in task["verifier"]["files"][
            f"tests_hidden/test_{task['metadata']['func']}.py"] or isinstance(expected, bool)
        assert args is not None


def test_task_files_load_in_the_project_format(tmp_path):
    tasks = generate(3, "heldout", ALL, 1)
    control = {**length_variant(tasks[0], 100), "id": "control"}
    path = write_tasks(tmp_path / "tasks.jsonl", [*tasks, control])
    loaded = load_tasks(path)
    assert [t.id for t in loaded] == [t["id"] for t in tasks] + ["control"]
    assert loaded[-1].verifier.reward == "script"
    assert read_tasks(path) == [*tasks, control]


def test_a_held_out_file_without_cases_is_refused_with_its_line(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"id": "a", "prompt": "p", "metadata": {}}) + "\n")
    with pytest.raises(ValueError, match="line 1: the evaluation needs metadata.func"):
        read_tasks(path)


def test_reply_length_reward():
    assert reply_length_reward("x" * 100, 100) == 1.0
    assert reply_length_reward("x" * 50, 100) == 0.5
    assert reply_length_reward("x" * 300, 100) == 0.0


# ---- statistics on known inputs ----

def test_paired_differences_per_prompt():
    a = {"p": [True, False], "q": [False, False], "only_a": [True]}
    b = {"p": [True, True], "q": [True, False], "only_b": [False]}
    assert stats.paired_differences(a, b) == {"p": 0.5, "q": 0.5}


def test_sign_flip_exact_on_known_inputs():
    # 4 equal positive differences: only all-plus and all-minus reach |mean| = 1 of 16 patterns.
    assert stats.sign_flip_p([1, 1, 1, 1]) == pytest.approx(2 / 16)
    assert stats.sign_flip_p([0, 0, 0]) == 1.0
    # 1 and 3: |mean| is 2 for ++ and --, 1 for +- and -+.
    assert stats.sign_flip_p([1, 3]) == pytest.approx(0.5)


def test_sign_flip_monte_carlo_sees_a_large_effect():
    assert stats.sign_flip_p([0.5] * 40) < 0.001
    assert stats.sign_flip_p([0.5, -0.5] * 20) == 1.0


def test_cluster_bootstrap_of_constant_differences_is_a_point():
    assert stats.cluster_bootstrap([0.25] * 30) == pytest.approx((0.25, 0.25))


def test_mde_from_the_aa_spread():
    diffs = [0.1, -0.1] * 32  # sd (ddof=1) = 0.1 * sqrt(64/63)
    expected = (1.959964 + 0.841621) * 0.1 * math.sqrt(64 / 63) / 8
    assert stats.mde(diffs) == pytest.approx(expected, rel=1e-5)
    assert stats.mde(diffs, prompts=256) == pytest.approx(expected / 2, rel=1e-5)


@given(st.lists(st.floats(-1, 1), min_size=2, max_size=30))
@settings(max_examples=50, deadline=None)
def test_sign_flip_is_symmetric_and_a_probability(diffs):
    p = stats.sign_flip_p(diffs)
    assert 0 < p <= 1
    assert p == pytest.approx(stats.sign_flip_p([-d for d in diffs]))


@given(st.lists(st.floats(-1, 1), min_size=1, max_size=40))
@settings(max_examples=50, deadline=None)
def test_bootstrap_interval_is_ordered_and_within_the_data(diffs):
    lo, hi = stats.cluster_bootstrap(diffs, rounds=500)
    assert min(diffs) - 1e-12 <= lo <= hi <= max(diffs) + 1e-12


def test_summary_of_a_known_effect():
    a = {f"p{i}": [False] * 8 for i in range(20)}
    b = {f"p{i}": [True] * 4 + [False] * 4 for i in range(20)}
    s = stats.summary(a, b)
    assert s["effect"] == pytest.approx(0.5) and s["a"] == 0 and s["b"] == 0.5
    assert s["ci_low"] == pytest.approx(0.5) and s["p_sign_flip"] < 0.001
