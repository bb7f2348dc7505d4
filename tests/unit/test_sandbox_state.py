"""The runner's state file and the summary table."""

from __future__ import annotations

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from sandbox.runner import plan
from sandbox.state import FinishedRollout, RunHeader, StateFile
from sandbox.summary import format_table, summarize, trained_tokens
from sandbox.tasks import Task, Verifier


def record(task="t", repeat=0, member=0, status="finished", reward=1.0, calls=2, tokens=10):
    return FinishedRollout(task_id=task, repeat=repeat, member=member, rollout_id=f"r{member}",
                           group_id="g", status=status, sandbox_status="ok", reward=reward,
                           reward_detail="", duration_s=1.0, calls=calls, trained_tokens=tokens)


def test_round_trip_and_torn_last_line(tmp_path):
    state = StateFile(tmp_path / "state.jsonl")
    assert state.load() == (None, {})
    header = RunHeader(run_id="abc", created=1.0)
    state.append(header)
    state.append(record(member=0))
    state.append(record(member=1, reward=None))
    with open(state.path, "ab") as fh:
        fh.write(b'{"type": "rollout", "task_id": "t", "rep')  # a crash mid-write
    got_header, done = state.load()
    assert got_header == header
    assert set(done) == {("t", 0, 0), ("t", 0, 1)} and done[("t", 0, 1)].reward is None
    # The torn tail is cut off, so the next record starts a line of its own.
    state.append(record(member=2))
    assert set(state.load()[1]) == {("t", 0, 0), ("t", 0, 1), ("t", 0, 2)}


def task(tid: str) -> Task:
    return Task(id=tid, prompt="p", files={}, verifier=Verifier("true", "binary", {}))


@given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 3),
       st.sets(st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(0, 2), st.integers(0, 3))))
def test_plan_covers_every_missing_key_once(n_tasks, group_size, repeat, done):
    tasks = [task(t) for t in ["a", "b", "c", "d"][:n_tasks]]
    items = plan(tasks, group_size, repeat, "run1", done)
    keys = [i.key for i in items]
    expected = {(t.id, r, m) for t in tasks for r in range(repeat)
                for m in range(group_size)} - done
    assert len(keys) == len(set(keys)) and set(keys) == expected
    for item in items:  # one group per (task, repeat), the same in every run with this id
        assert item.group_id == f"run1-{item.task.id}-r{item.repeat}"


def test_summary_table():
    records = [record("a", 0, 0, reward=1.0), record("a", 0, 1, "failed", 0.0),
               record("a", 1, 0, "timeout", None, calls=1, tokens=3),
               record("b", 0, 0, reward=0.5, calls=4, tokens=40),
               msgspec.structs.replace(record("b", 0, 1, reward=0.0), sandbox_status="tampered")]
    (a, b) = summarize(records, errors={"b": 2})
    assert (a.rollouts, a.statuses, a.rewards) == (
        3, {"finished": 1, "failed": 1, "timeout": 1}, [1.0, 0.0, None])
    assert a.mean_reward == 0.5 and (a.calls, a.trained_tokens) == (5, 23)
    assert (b.errors, b.tampered, a.tampered) == (2, 1, 0)
    table = format_table([a, b])
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["task", "n", "finished"]
    # columns: task n finished failed timeout tampered errors mean calls tokens rewards
    assert lines[2].split()[:11] == ["a", "3", "1", "1", "1", "0", "0", "0.50", "5", "23",
                                     "1.00"]
    assert lines[-1].split()[:10] == ["all", "5", "3", "1", "1", "1", "2", "0.38", "11", "73"]


def test_trained_tokens_prefers_merge_stats():
    assert trained_tokens({"trained_tokens": 7}, 20) == 7
    assert trained_tokens(None, 20) == 20
    assert trained_tokens({}, None) is None
