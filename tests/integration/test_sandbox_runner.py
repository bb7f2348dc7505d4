"""The rollout runner's orchestration, against a STAND-IN for the gateway's admin API.

`StandInAdminAPI` (tests/support/stand_in_admin.py) is not the gateway: it implements only the
shape of the admin API the runner uses (create, finish, get, the models it checks first; admin
key checked) plus a trivial chat endpoint that counts calls per rollout key, so grouping, the
concurrency bound, crash and timeout handling, interruption and resume can be checked with real
sandboxes and real subprocesses. The runner against the real gateway is covered by the gateway's
integration tests.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections import Counter
from pathlib import Path

import msgspec
import pytest

from sandbox.backends.local import LocalBackend
from sandbox.cli import run_cli
from sandbox.runner import run_rollouts
from sandbox.state import StateFile
from sandbox.summary import format_table, summarize
from tests.support.stand_in_admin import ADMIN_KEY, task

REPO = Path(__file__).resolve().parents[2]
async def test_groups_concurrency_calls_and_summary(admin_api, harness, monkeypatch):
    monkeypatch.setenv("ROLLTAP_ADMIN_KEY", ADMIN_KEY)  # as the CLI would hold it
    lines = []
    report = await run_rollouts(
        [task("a", "slow 0.2"), task("b", "slow 0.2")], harness, gateway=admin_api.url,
        admin_key=ADMIN_KEY, group_size=3, repeat=2, concurrency=3, backend=LocalBackend(),
        on_finished=lambda rec, prog: lines.append((rec, prog)),
    )
    assert report.errors == [] and len(report.finished) == 12 and not report.interrupted
    rollouts = list(admin_api.rollouts.values())
    assert len(rollouts) == 12
    assert {(r["status"], r["reward"]) for r in rollouts} == {("finished", 1.0)}
    # A python agent's toolless calls are left to the gateway's rule (npm presets: toolless).
    assert {r["side_calls"] for r in rollouts} == {"auto"}

    groups: dict[tuple, set] = {}
    for r in rollouts:
        groups.setdefault((r["task_id"], r["metadata"]["repeat"]), set()).add(r["group_id"])
    assert len(groups) == 4 and all(len(ids) == 1 for ids in groups.values())
    assert len({next(iter(ids)) for ids in groups.values()}) == 4
    assert admin_api.created_keys() == Counter(
        {(t, r, m): 1 for t in "ab" for r in range(2) for m in range(3)})

    assert admin_api.max_in_flight == report.max_in_flight == 3
    assert [p.done for _, p in lines] == list(range(1, 13))
    assert all(p.total == 12 for _, p in lines)
    assert {(rec.calls, rec.prompt_tokens, rec.trained_tokens) for rec in report.finished} == {
        (2, 22, 10)}
    assert all(r["metrics"]["sandbox_status"] == "ok" for r in rollouts)
    # The admin key never reached a sandbox; each sandbox had its own rollout key.
    assert len(admin_api.bodies) == 24
    for body in admin_api.bodies:
        env = json.loads(json.loads(body)["messages"][0]["content"])
        assert ADMIN_KEY not in json.dumps(env) and "ROLLTAP_ADMIN_KEY" not in env
        assert env["OPENAI_API_KEY"].startswith("rk-")

    table = format_table(summarize(report.finished))
    assert [line.split()[:3] for line in table.splitlines() if line.split()[0] in "ab"] == [
        ["a", "6", "6"], ["b", "6", "6"]]


@pytest.mark.parametrize(("crash_reward", "crash_value"), [("zero", 0.0), ("null", None)])
async def test_crash_and_timeout_are_survived(admin_api, harness, crash_reward, crash_value):
    tasks = [task("crashes", "crash"), task("hangs", "hang", agent_s=1.0), task("works", "ok")]
    report = await run_rollouts(
        tasks, harness, gateway=admin_api.url, admin_key=ADMIN_KEY, group_size=2,
        concurrency=4, backend=LocalBackend(), crash_reward=crash_reward,
    )
    assert report.errors == [] and len(report.finished) == 6
    outcome = {(r["task_id"], r["status"], r["reward"]) for r in admin_api.rollouts.values()}
    assert outcome == {("crashes", "failed", crash_value), ("hangs", "timeout", crash_value),
                       ("works", "finished", 1.0)}
    assert admin_api.in_flight == 0  # every rollout was finished at the gateway
    by_task = {s.task_id: s for s in summarize(report.finished)}
    assert by_task["crashes"].statuses == {"failed": 2}
    assert by_task["hangs"].statuses == {"timeout": 2}
    crashed = next(r for r in admin_api.rollouts.values() if r["task_id"] == "crashes")
    assert crashed["metrics"]["exit_code"] == 3


async def test_interrupt_then_resume_does_not_redo(admin_api, harness, tmp_path):
    state = tmp_path / "state.jsonl"
    tasks = [task(t, "slow 0.2") for t in ("a", "b", "c")]
    stop = asyncio.Event()

    def stop_after_two(record, progress):
        if progress.done >= 2:
            stop.set()

    first = await run_rollouts(
        tasks, harness, gateway=admin_api.url, admin_key=ADMIN_KEY, group_size=2,
        concurrency=2, backend=LocalBackend(), state_path=str(state), stop=stop,
        on_finished=stop_after_two,
    )
    assert first.interrupted and 2 <= len(first.finished) < 6
    interrupted = [r for r in admin_api.rollouts.values() if r["status"] != "finished"]
    assert all(r["status"] == "failed" and r["metrics"] == {"interrupted": True}
               for r in interrupted)
    assert admin_api.in_flight == 0
    _, done = StateFile(state).load()
    assert set(done) == {rec.key for rec in first.finished}

    second = await run_rollouts(
        tasks, harness, gateway=admin_api.url, admin_key=ADMIN_KEY, group_size=2,
        concurrency=2, backend=LocalBackend(), state_path=str(state),
    )
    assert not second.interrupted and second.skipped == len(first.finished)
    assert len(first.finished) + len(second.finished) == 6
    all_keys = {(t, 0, m) for t in "abc" for m in range(2)}
    assert admin_api.finished_keys() == Counter({k: 1 for k in all_keys})
    for key in set(done):  # finished in the first run: never created again
        assert admin_api.created_keys()[key] == 1
    # Resumed members joined the groups their siblings started.
    groups: dict[str, set] = {}
    for r in admin_api.rollouts.values():
        groups.setdefault(r["task_id"], set()).add(r["group_id"])
    assert all(len(ids) == 1 for ids in groups.values())
    assert set(StateFile(state).load()[1]) == all_keys


async def test_a_run_id_given_names_the_run_and_a_resume_must_match_it(admin_api, harness,
                                                                       tmp_path):
    state = tmp_path / "state.jsonl"
    report = await run_rollouts(
        [task("a", "ok")], harness, gateway=admin_api.url, admin_key=ADMIN_KEY, group_size=2,
        backend=LocalBackend(), state_path=str(state), run_id="ours-1",
    )
    assert report.run_id == "ours-1" and StateFile(state).load()[0].run_id == "ours-1"
    assert {r["metadata"]["run_id"] for r in admin_api.rollouts.values()} == {"ours-1"}
    with pytest.raises(ValueError, match="belongs to run ours-1, not other"):
        await run_rollouts(
            [task("a", "ok")], harness, gateway=admin_api.url, admin_key=ADMIN_KEY,
            group_size=2, backend=LocalBackend(), state_path=str(state), run_id="other",
        )


async def test_gateway_refusal_is_an_error_for_that_rollout_only(admin_api, harness):
    admin_api.refuse_tasks = {"refused"}
    errors = []
    report = await run_rollouts(
        [task("refused", "ok"), task("fine", "ok")], harness, gateway=admin_api.url,
        admin_key=ADMIN_KEY, group_size=2, concurrency=2, backend=LocalBackend(),
        on_error=lambda e, p: errors.append(e),
    )
    assert [(e.task_id, e.member) for e in report.errors] == [("refused", 0), ("refused", 1)]
    assert "HTTP 400" in errors[0].message
    assert [r.task_id for r in report.finished] == ["fine", "fine"]


class FailingBackend:
    """Fault injection: a backend that fails every sandbox (a broken machine)."""

    async def run(self, request):
        raise OSError(28, "No space left on device")


async def test_a_failed_sandbox_is_in_the_state_file_and_not_redone(admin_api, harness,
                                                                    tmp_path):
    state = tmp_path / "state.jsonl"
    common = dict(gateway=admin_api.url, admin_key=ADMIN_KEY, group_size=1,
                  state_path=str(state))
    first = await run_rollouts([task("a", "ok")], harness, backend=FailingBackend(), **common)
    assert len(first.errors) == 1 and "No space left" in first.errors[0].message
    _, done = StateFile(state).load()
    (record,) = done.values()
    assert (record.status, record.sandbox_status, record.reward) == ("failed", "error", None)
    second = await run_rollouts([task("a", "ok")], harness, backend=LocalBackend(), **common)
    assert second.skipped == 1 and len(admin_api.rollouts) == 1


async def test_wrong_admin_key_fails_every_rollout(admin_api, harness):
    report = await run_rollouts(
        [task("a", "ok")], harness, gateway=admin_api.url, admin_key="wrong",
        group_size=1, backend=LocalBackend(),
    )
    assert len(report.errors) == 1 and "HTTP 401" in report.errors[0].message
    assert admin_api.rollouts == {}


def test_cli_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_cli(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--harness", "--group-size", "--gateway", "--admin-key", "--concurrency",
                 "--backend", "--model", "--repeat", "--state", "--crash-reward"):
        assert flag in out
    assert "ROLLTAP_ADMIN_KEY" in out and "claude-code" in out


def test_cli_rejects_bad_input(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("ROLLTAP_ADMIN_KEY", raising=False)
    tasks = tmp_path / "tasks.jsonl"
    binary = {"command": "true", "reward": "binary"}
    tasks.write_text(json.dumps({"id": "x", "prompt": 3, "verifier": binary}) + "\n")
    base = [str(tasks), "--harness", "command", "--command", "true", "--group-size", "1",
            "--gateway", "http://127.0.0.1:9"]
    assert run_cli(base) == 2
    assert "ROLLTAP_ADMIN_KEY" in capsys.readouterr().err
    assert run_cli([*base, "--admin-key", "k"]) == 2
    assert 'line 1: field "prompt": expected a string' in capsys.readouterr().err
    tasks.write_text(json.dumps({"id": "x", "prompt": "p", "verifier": binary}) + "\n")
    assert run_cli([*base[:2], "python", *base[5:], "--admin-key", "k"]) == 2
    assert "--agent" in capsys.readouterr().err
    assert run_cli([*base[:4], "no-such-binary-xyz", *base[5:], "--admin-key", "k"]) == 2
    assert "not on PATH" in capsys.readouterr().err


async def test_cli_sigint_then_resume(admin_api, harness, tmp_path):
    tasks_file = tmp_path / "tasks.jsonl"
    tasks_file.write_text("".join(
        json.dumps({"id": t, "prompt": "slow 0.3", "files": {"README.md": "x"},
                    "verifier": {"command": "test -f out.txt", "reward": "binary"},
                    "timeouts": {"agent_s": 60}}) + "\n" for t in ("p", "q")))
    state = tmp_path / "state.jsonl"
    argv = [sys.executable, "-m", "sandbox.cli", str(tasks_file), "--harness", "python",
            "--agent", harness.agent, "--pythonpath", harness.pythonpath[0],
            "--group-size", "2", "--concurrency", "2", "--gateway", admin_api.url,
            "--state", str(state)]
    env = dict(os.environ, ROLLTAP_ADMIN_KEY=ADMIN_KEY)

    proc = await asyncio.create_subprocess_exec(*argv, env=env, cwd=REPO,
                                                stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)
    output = []
    while line := await asyncio.wait_for(proc.stdout.readline(), 60):
        output.append(line.decode())
        if line.startswith(b"[1/4]"):
            proc.send_signal(signal.SIGINT)
            break
    output.append((await asyncio.wait_for(proc.stdout.read(), 60)).decode())
    assert await proc.wait() == 130, "".join(output)
    text = "".join(output)
    assert "stopping" in text and "interrupted:" in text and "--state" in text
    first_done = set(StateFile(state).load()[1])
    assert 1 <= len(first_done) < 4

    proc = await asyncio.create_subprocess_exec(*argv, env=env, cwd=REPO,
                                                stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 120)
    text = out.decode()
    assert proc.returncode == 0, text
    assert f"({len(first_done)} rollouts were finished by an earlier run" in text
    table = text[text.index("task "):].splitlines()
    assert table[0].split()[:2] == ["task", "n"]
    assert [row.split()[:3] for row in table if row.split()[:1] in (["p"], ["q"], ["all"])] == [
        ["p", "2", "2"], ["q", "2", "2"], ["all", "4", "4"]]
    expected = {(t, 0, m) for t in "pq" for m in range(2)}
    assert admin_api.finished_keys() == Counter({k: 1 for k in expected})
    for key in first_done:
        assert admin_api.created_keys()[key] == 1
    for body in admin_api.bodies:  # the CLI held the admin key in its env; sandboxes did not
        assert ADMIN_KEY.encode() not in body
    records = [msgspec.json.decode(line) for line in state.read_bytes().splitlines()]
    assert records[0]["type"] == "run" and len(records) == 5
