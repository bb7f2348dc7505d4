"""Tests of trainer_bridge.narration: what the bridge says while it trains nothing (pure, with a
clock of the test's own)."""

import re
import uuid
from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from trainer_bridge.handover import Held
from trainer_bridge.narration import Narrator, Waiting, group_account
from trainer_bridge.release import Member


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _narrator(lines, clock, **kw):
    return Narrator(num_generations=4, token_budget=256, group_deadline_s=600, say=lines.append,
                    clock=clock, **kw)


def test_a_useless_group_gets_one_line_per_cause_at_most_every_30_s_with_a_count():
    lines, clock = [], Clock()
    narrator = _narrator(lines, clock)
    narrator.group_released("g1", 4, 0, {"auxiliary": 64})
    assert len(lines) == 1
    assert lines[0].startswith("rolltap bridge: group g1 (4 rollouts) gives the trainer no "
                               "trainable token: excluded auxiliary 64.")
    assert "--train-auxiliary" in lines[0]
    for k in range(3):
        clock.now += 5
        narrator.group_released(f"g{k + 2}", 4, 0, {"auxiliary": 64})
    narrator.group_released("c", 4, 0, {"constrained": 9, "auxiliary": 1})  # another cause
    assert len(lines) == 2 and "--train-constrained" in lines[1]
    clock.now = 31
    narrator.group_released("g9", 4, 0, {"auxiliary": 64})
    assert len(lines) == 3 and "(and 3 more such groups since the last line)" in lines[2]
    narrator.group_released("fine", 4, 10, {"auxiliary": 64})  # trained something: silent
    assert len(lines) == 3


def test_a_run_of_useless_groups_warns_every_30_s():
    lines, clock = [], Clock()
    narrator = _narrator(lines, clock, window=3)
    idle = Waiting(0, 0)
    for k in range(3):
        narrator.group_released(f"g{k}", 4, 0, {"zero_advantage": 10})
    lines.clear()
    narrator.stepped()
    narrator.tick(idle)
    [warning] = lines
    assert warning.startswith("rolltap bridge: warning: the last 3 groups this bridge consumed "
                              "trained nothing (excluded zero_advantage 30)")
    clock.now += 10
    narrator.tick(idle)
    assert len(lines) == 1
    narrator.group_released("ok", 4, 5, {})
    clock.now += 30
    narrator.stepped()
    narrator.tick(idle)
    assert len(lines) == 1  # a group trained: no warning


def test_a_bridge_short_of_a_step_says_what_the_trainer_holds_and_when_it_trains():
    lines, clock = [], Clock()
    narrator = _narrator(lines, clock)
    held = Held(samples=4, unique_tokens=61, loss_terms=48, rows_filled=1, rows=1)
    buffered = Waiting(samples=4, taken=4, gathering=2, gathered=5, deadline_in_s=540,
                       held=held, flush_in_s=31.4)
    clock.now = 29
    narrator.tick(buffered)
    assert lines == []
    clock.now = 30
    narrator.tick(buffered)
    [line] = lines
    assert line == (
        "rolltap bridge: no optimizer step for 30 s. The trainer holds a partial micro-batch: "
        "4 samples, 61 unique tokens and 48 loss terms as TRL's packer counts them (a row "
        "closes when the next sample would take either past --token-budget 256); it trains as "
        "it is in 31 s unless a sample arrives first "
        "(--flush-after 60). 2 groups wait for their members (5 rollouts finished, "
        "--num-generations 4, the first released at --group-deadline in 540 s).")
    clock.now = 45
    narrator.stepped()
    clock.now = 74
    narrator.tick(buffered)
    assert len(lines) == 1  # a step came 29 s ago
    clock.now = 75
    narrator.tick(Waiting(0, 0))
    assert lines[-1] == ("rolltap bridge: no optimizer step for 30 s. The trainer holds no "
                         "sample. No finished rollout waits: is the runner producing any?")
    clock.now = 200
    narrator.tick(Waiting(4, 4, trainer_waiting=False))  # a long step runs
    assert len(lines) == 2
    # Two ranks, one row filled: the micro-batch cannot close, and the line says why.
    clock.now = 300
    narrator.tick(Waiting(1, 1, held=Held(1, 20, 10, rows_filled=1, rows=2)))
    assert lines[-1].endswith("it trains once each of the 2 ranks' rows holds a sample (1 do).")
    # A full micro-batch waits in accelerate's dispatcher with the open one: said, not mixed in.
    clock.now = 400
    narrator.tick(Waiting(22, 22, held=held, flush_in_s=3))
    assert ("4 samples, 61 unique tokens and 48 loss terms" in lines[-1]
            and "after a full one of 18 samples that trains first; it trains as it is in 3 s"
            in lines[-1])


def test_a_group_account_sums_its_members_ledgers():
    a, b, c = (uuid.uuid4() for _ in range(3))
    members = [Member(id=a, merge_stats={"trained_tokens": 5,
                                         "excluded_by_cause": {"auxiliary": 3}}),
               Member(id=b, merge_stats={"trained_tokens": 0,
                                         "excluded_by_cause": {"auxiliary": 7}}),
               Member(id=c, merge_stats={"trained_tokens": 4})]
    trained, excluded = group_account(members, {a: 1.0, b: -1.0}, {c},
                                      [(a, "trained", 5, 0)])
    assert trained == 5
    assert +excluded == Counter(auxiliary=10, dropped=4)
    trained, excluded = group_account(members[:2], {a: 0.0, b: 0.0}, (),
                                      [(a, "trained", 5, 0)])
    assert trained == 0 and excluded["zero_advantage"] == 5


@given(st.lists(st.tuples(st.floats(0, 40), st.sampled_from(["auxiliary", "constrained", "stale"]),
                          st.sampled_from([0, 0, 3])), max_size=40))
def test_cause_lines_are_rate_limited_per_cause_and_count_every_useless_group(events):
    lines, clock = [], Clock()
    narrator = _narrator(lines, clock)
    said_at, said = {}, Counter()
    useless = Counter()
    for dt, cause, trained in events:
        clock.now += dt
        before = len(lines)
        narrator.group_released("g", 4, trained, {cause: 8})
        useless[cause] += not trained
        if len(lines) > before:
            [line] = lines[before:]
            assert f"excluded {cause} 8" in line
            assert clock.now - said_at.get(cause, -1e9) >= 30
            said_at[cause] = clock.now
            more = re.search(r"and (\d+) more such groups", line)
            said[cause] += 1 + (int(more.group(1)) if more else 0)
    for cause in useless:
        # Every useless group is in some line, or held for the next one.
        assert said[cause] + narrator._held[cause] == useless[cause]
