"""Harbor tasks and agents through rolltap (issue 26).

Pure parts: what a trial's result means for its rollout, and reading Harbor task directories.
Integration: `rolltap rollouts DIR --harness harbor:AGENT` as a user runs it (a real process),
against the real gateway, with Harbor 0.25.0 in its own venv (made by `make install`) running
each rollout as one trial in rolltap's persistent bubblewrap environment. The fixture tasks are
examples/harbor/ (hello-world, a multi-key reward.json, a service that must persist between
execs, an environment that never becomes healthy) and tests/harbor (what the agent phase can
reach, whether the verifier saw the key, a memory cap, an agent that tries to change its reward
after it stops).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sandbox import images
from sandbox.harbor import podman
from sandbox.harbor.backend import harbor_python, trial_outcome
from sandbox.harbor.protocol import TrialReply
from sandbox.harbor.tasks import load_harbor_tasks, task_dirs
from sandbox.tasks import TaskFileError
from tests.support.harbor import needs_harbor, rollouts

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "harbor"
FIXTURES = REPO / "tests" / "harbor"
# The agents' wheels `make install` downloads (the Makefile's MSWEA_WHEELS).
HARBOR_WHEELS = REPO / ".cache" / "harbor-wheels"

keys = st.text(st.characters(categories=["Ll"]), min_size=1, max_size=8)
rewards = st.dictionaries(keys, st.floats(-10, 10, allow_nan=False), max_size=5)


# ---- pure -----------------------------------------------------------------------------------


@given(rewards, keys, st.floats(0, 1))
def test_reward_key_is_the_reward_and_other_keys_are_metrics(others, key, value):
    reply = TrialReply(id=1, rewards={**others, key: value}, reward_valid=True)
    out = trial_outcome(reply, key)
    assert (out.status, out.reward) == ("ok", value)
    rest = {k: v for k, v in others.items() if k != key}
    assert out.metrics.get("harbor_rewards", {}) == rest


@given(st.one_of(st.none(), rewards), st.sampled_from(["sandbox_failed", "verifier_failed",
                                                        None]))
def test_invalid_reward_is_unscorable_with_its_cause(found, cause):
    reply = TrialReply(id=1, rewards=found, reward_valid=False, failure_cause=cause,
                       exception="HealthcheckError: never healthy")
    out = trial_outcome(reply)
    assert (out.status, out.reward) == ("setup_failed", None)
    assert "never healthy" in out.detail and out.detail.startswith("unscorable")
    assert out.metrics["harbor_exception"] == "HealthcheckError: never healthy"


def test_missing_reward_key_is_unscorable_and_says_which_keys_there_are():
    out = trial_outcome(TrialReply(id=1, rewards={"score": 1.0}, reward_valid=True))
    assert out.reward is None and "'reward'" in out.detail and "score" in out.detail
    assert "--reward-key" in out.detail


def test_an_agent_that_failed_is_judged_by_its_work():
    """The model's doing (an agent exiting 1 after its calls) is never unscorable: the
    verifier's reward where it gave one, else 0."""
    error = "NonZeroAgentExitCodeError: codex exited 1\nIncomplete response returned"
    judged = trial_outcome(TrialReply(id=1, rewards={"reward": 1.0}, reward_valid=True,
                                      agent_error=error))
    assert (judged.status, judged.reward) == ("ok", 1.0)
    assert judged.metrics["harbor_agent_error"] == error
    assert "judged by its work: NonZeroAgentExitCodeError" in judged.detail
    unverified = trial_outcome(TrialReply(id=1, rewards=None, reward_valid=False,
                                          failure_cause="verifier_failed", agent_error=error))
    assert (unverified.status, unverified.reward) == ("ok", 0.0)


def test_worker_error_is_unscorable():
    out = trial_outcome(TrialReply(id=1, rewards=None, reward_valid=False,
                                   error="ValueError: unknown agent"))
    assert (out.status, out.reward) == ("setup_failed", None)
    assert out.metrics["harbor_error"] == "ValueError: unknown agent"


@given(st.lists(st.sampled_from(["/", "/app", "/logs", "/root", "/home/u/work"]), max_size=4),
       st.integers(1, 1 << 20))
def test_image_stage_bounds_the_overlay_and_gives_the_trials_root_its_directories(owned, uid):
    """The Harbor sandbox's root stage: the writable layer on a tmpfs of the trial's size,
    mounted before anything is written there; the merged root and every owned directory (made
    first, never through a link) given to the sandbox's uid, and `/` never recursively."""
    from sandbox import confine

    image = confine.Image("/cache/rootfs", "/tmp/overlay")
    staged = {"/cache/rootfs": "/tmp/s0", "/tmp/overlay": "/tmp/s1"}
    lines = confine.stage_script(image, staged, [], size_mb=64, owner=uid,
                                 owned=owned).splitlines()
    mount = lines.index("mount -t tmpfs -o size=64m,mode=0700,nosuid,nodev rolltap-overlay "
                        "/tmp/s1")
    assert mount < next(i for i, ln in enumerate(lines) if "/tmp/s1/upper" in ln)
    assert f"chown {uid}:{uid} {confine.STAGED_ROOT}" in lines
    for path in {p for p in owned if p != "/"}:
        where = confine.STAGED_ROOT + path
        give = lines.index(f"chown -R -P {uid}:{uid} {where}")
        assert lines[give - 1] == f"mkdir -p {where}"
        assert lines[give - 2].startswith("no_links ") and lines[give - 2].endswith(where)
    assert f"chown -R -P {uid}:{uid} {confine.STAGED_ROOT}/\n" not in "\n".join(lines) + "\n"
    # Without them (rolltap's own image sandboxes): neither.
    plain = confine.stage_script(image, staged, [])
    assert "tmpfs" not in plain and "chown -R" not in plain


AGENT_UID = 2_000_000_007
SYSTEM = {"usr": None, "etc": None, "bin": "usr/bin", "lib64": "usr/lib64"}


@given(st.dictionaries(
    st.sampled_from(["usr", "etc", "bin", "lib64", "app", "tests", "logs", "tmp", "root", "proc",
                     "dev", "opt", "srv", "notes.txt"]),
    st.tuples(st.sampled_from(["dir", "link", "file", ""]),
              st.sampled_from([0, AGENT_UID]))),
    st.sampled_from([None, "app", "root", "usr", "logs"]))
def test_verifier_view_trusts_nothing_the_agent_made_in_its_system_directories(entries, copy):
    """The verifier's root: the system directories' links from the trusted layout whatever
    the agent left there, their directories bound only when the agent does not own them;
    /tests, /logs, /tmp and /root its own (the workdir's top copied instead, when it is one of
    them but Harbor's), each name once."""
    from sandbox.harbor.verifier_view import FRESH, plan

    steps = plan(entries, SYSTEM, copy, AGENT_UID)
    by_name = {name: (action, arg) for action, name, arg in steps}
    assert len(by_name) == len(steps)
    assert by_name["bin"] == ("link", "usr/bin") and by_name["lib64"] == ("link", "usr/lib64")
    for name in ("usr", "etc"):
        kind, owner = entries.get(name, ("", AGENT_UID))
        assert (by_name.get(name) == ("bind", None)) == (kind == "dir" and owner != AGENT_UID)
    copied = copy if copy in ("app", "root") and entries.get(copy, ("",))[0] == "dir" else None
    for name, mode in FRESH.items():
        assert by_name[name] == (("copy", None) if name == copied else ("fresh", mode))
    if copied:
        assert by_name[copied] == ("copy", None)
    for name, (kind, _) in entries.items():
        if name not in SYSTEM and name not in FRESH and name != copied and kind:
            assert by_name[name][0] == ("link" if kind == "link" else "bind_rw"
                                        if name in ("dev", "proc") else "bind")


def test_verifier_view_remounts_read_only_keeping_a_mounts_flags():
    from sandbox.harbor import verifier_view as v

    flags = v.remount_flags(v.MS_NODEV | v.MS_NOEXEC | v.ST_RELATIME)
    assert flags & v.MS_RDONLY and flags & v.MS_NOSUID and flags & v.MS_REMOUNT
    assert flags & v.MS_NODEV and flags & v.MS_NOEXEC and flags & v.MS_RELATIME
    assert not v.remount_flags(0) & (v.MS_NODEV | v.MS_RELATIME)


def test_task_directories_are_found_by_task_toml(tmp_path):
    assert [d.name for d in task_dirs(str(EXAMPLES))] == [
        "hello-world", "multi-key", "persistent", "unhealthy"]
    assert task_dirs(str(EXAMPLES / "hello-world")) == [EXAMPLES / "hello-world"]
    (task,) = load_harbor_tasks(str(EXAMPLES / "hello-world"))
    assert task.id == "hello-world" and "Hello, world!" in task.prompt
    assert (task.timeouts.agent_s, task.timeouts.verifier_s) == (120.0, 60.0)
    with pytest.raises(TaskFileError, match="no task.toml"):
        task_dirs(str(tmp_path))
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "task.toml").write_text("[agent]\ntimeout_sec = -1\n")
    (tmp_path / "t" / "instruction.md").write_text("x")
    with pytest.raises(TaskFileError, match="timeout_sec must be a positive number"):
        load_harbor_tasks(str(tmp_path))


def test_summary_names_another_harbor_backends_isolation():
    from sandbox.state import FinishedRollout
    from sandbox.summary import isolation_line

    record = FinishedRollout("t", 0, 0, "r", "g", "finished", "ok", 1.0, "", 1.0,
                             isolation="harbor")
    assert "Harbor environment's own" in isolation_line([record], "bwrap")


def test_a_directory_without_a_harbor_harness_says_what_to_do(capsys):
    from sandbox.cli import run_cli

    code = run_cli([str(EXAMPLES), "--harness", "python", "--agent", "a:b", "--group-size",
                    "1", "--gateway", "http://127.0.0.1:9", "--admin-key", "k"])
    assert code == 2 and "--harness harbor:AGENT" in capsys.readouterr().err


# ---- through the gateway --------------------------------------------------------------------


@needs_harbor
def test_oracle_scores_and_infrastructure_failure_is_unscorable(gateway, vllm_server, tmp_path):
    # Four trials at once, one agent and one verifier slot (issue #42's pools on real trials).
    out, states, trials = rollouts(gateway, tmp_path, EXAMPLES, "oracle", "--model",
                                   vllm_server.model, "--agent-slots", "1", "--verify-slots", "1")
    for phase in ("agent_execution", "verifier"):
        spans = _phase_spans(trials, phase)
        assert len(spans) == 3, (phase, spans)  # all but the trial that never got healthy
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:])), (phase, spans)
    assert re.search(r"agent 1 slots, 3 taken.*verify 1 slots, 3 taken", out), out
    hello = states["hello-world"]
    assert (hello["status"], hello["reward"]) == ("finished", 1.0)
    assert hello["metrics"]["isolation"] == "bwrap"
    # A multi-key reward.json: `reward` is the reward, the other keys are metrics.
    multi = states["multi-key"]
    assert (multi["status"], multi["reward"]) == ("finished", 1.0)
    assert multi["metrics"]["harbor_rewards"] == {"lines": 3.0, "partial": 0.5}
    # A background process of one exec is still there in the next: one persistent sandbox.
    assert states["persistent"]["reward"] == 1.0
    # Never healthy: unscorable (null, never 0), the cause in the metrics and the summary.
    sick = states["unhealthy"]
    assert (sick["status"], sick["reward"]) == ("failed", None)
    assert sick["metrics"]["harbor_failure_cause"] == "sandbox_failed"
    assert "HealthcheckError" in sick["metrics"]["harbor_exception"]
    assert "unscorable: sandbox_failed: HealthcheckError" in out
    # Harbor's retries are off: the failed trial ran once, as one rollout.
    assert len(list(trials.glob("unhealthy__*"))) == 1
    # Counted by cause in the summary and at the gateway (issue 38).
    assert "unscorable: 1 of 4 (sandbox_failed: 1)" in out
    assert sick["metrics"]["unscorable_cause"] == "sandbox_failed"
    time.sleep(10.5)  # the database-derived gauges are refreshed at most every 10 s
    assert 'rolltap_rollouts_unscorable{cause="sandbox_failed"}' in gateway.admin.get(
        "/metrics").text


def _phase_spans(trials: Path, phase: str) -> list[tuple[datetime, datetime]]:
    """When each trial ran `phase` (Harbor's result.json timing), in start order."""
    spans = []
    for result in trials.glob("*/result.json"):
        timing = json.loads(result.read_text()).get(phase) or {}
        if timing.get("started_at") and timing.get("finished_at"):
            spans.append((datetime.fromisoformat(timing["started_at"]),
                           datetime.fromisoformat(timing["finished_at"])))
    return sorted(spans)


@needs_harbor
def test_nop_scores_zero(gateway, vllm_server, tmp_path):
    _, states, _ = rollouts(gateway, tmp_path, EXAMPLES / "hello-world", "nop", "--model",
                            vllm_server.model)
    assert (states["hello-world"]["status"], states["hello-world"]["reward"]) == (
        "finished", 0.0)


def probe_reached_only_the_gateway(gateway, probe: dict) -> list[dict]:
    """The probe task's findings (tests/harbor/probe): one model call with the key, the admin
    API refused, no Postgres, no other secret, no key in the verifier. Returns its calls."""
    found = probe["metrics"]["harbor_rewards"]
    assert found["admin_status"] in (401.0, 403.0), found
    assert {k: v for k, v in found.items() if k != "admin_status"} == {
        "verifier_saw_key": 0.0, "chat_status": 200.0, "postgres_reached": 0.0}
    assert probe["reward"] == 1.0
    calls = gateway.calls(probe["rollout_id"])
    assert [c["status"] for c in calls] == ["ok"]
    return calls


@needs_harbor
def test_agent_phase_reaches_only_the_gateway_with_its_key(gateway, vllm_server, tmp_path):
    """The trial's agent phase calls the model through the gateway with the rollout's key
    (recorded with the engine's ids); it cannot use the admin API or reach Postgres, holds no
    other secret, and the verifier's environment has no key. The task's memory_mb holds."""
    _, states, _ = rollouts(gateway, tmp_path, FIXTURES, "oracle", "--model", vllm_server.model)
    assert states["memory-capped"]["reward"] == 0.0
    probe = states["probe"]
    calls = probe_reached_only_the_gateway(gateway, probe)
    assert calls[0]["prompt_ids"] and calls[0]["completion_ids"]
    assert len(calls[0]["logprobs"]) == len(calls[0]["completion_ids"])
    # Merged into a trace as any rollout is (a toolless call: auxiliary, not trained).
    stats = probe["merge"]["stats"]
    assert stats["sequences"] == 1 and stats["lost_tokens"] == 0, stats


@needs_harbor
def test_agent_cannot_change_the_reward_after_it_stops(gateway, tmp_path):
    """tests/harbor/hostile: a wrong answer, then a process left rewriting the reward files, a
    usercustomize in the agent's home and a sitecustomize in the workdir, its own /bin/bash
    (the tests' interpreter), stale rewards and a conftest.py in /tests. The verifier phase
    runs as another uid in a view of its own: the wrong answer scores 0, the agent's process
    is still running but is not the verifier's uid, no hook ran, the verifier had no key, and
    it could write its copy of the workdir."""
    _, states, _ = rollouts(gateway, tmp_path, FIXTURES / "hostile", "oracle")
    hostile = states["hostile"]
    assert (hostile["status"], hostile["reward"]) == ("finished", 0.0), hostile
    assert hostile["metrics"]["harbor_rewards"] == {
        "rewriter_alive": 1.0, "same_uid": 0.0, "verifier_saw_key": 0.0, "hook_ran": 0.0,
        "wrote_workdir": 1.0}


@needs_harbor
async def test_ctrl_c_stops_the_trial_and_its_sandbox(tmp_path):
    """SIGINT while a trial's agent runs: the CLI exits 130, the rollout is finished as
    interrupted (against a STAND-IN admin API, tests/support/stand_in_admin.py), and the
    trial's sandbox is gone with every process in it."""
    import asyncio
    import shutil
    import signal

    from tests.support.stand_in_admin import ADMIN_KEY as STAND_IN_KEY
    from tests.support.stand_in_admin import StandInAdminAPI

    task = tmp_path / "tasks" / "slow"
    shutil.copytree(EXAMPLES / "hello-world", task)
    marker = f"{4000 + os.getpid() % 1000}.5"  # a sleep only this test's agent runs
    (task / "solution" / "solve.sh").write_text(f"#!/bin/bash\nsleep {marker}\n")
    api = StandInAdminAPI()
    await api.start()
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "sandbox.cli", str(task.parent), "--harness", "harbor:oracle",
            "--group-size", "1", "--gateway", api.url, "--trials-dir", str(tmp_path / "t"),
            "--environment-kwarg", "rootfs=host",
            cwd=REPO, env={**os.environ, "ROLLTAP_ADMIN_KEY": STAND_IN_KEY},
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)

        def sleeping() -> bool:
            found = subprocess.run(["pgrep", "-f", f"sleep {marker}"], capture_output=True)
            return found.returncode == 0

        for _ in range(600):
            if sleeping():
                break
            await asyncio.sleep(0.1)
        assert sleeping(), "the trial's agent never started"
        proc.send_signal(signal.SIGINT)
        out, _ = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 130, out.decode()
        (rollout,) = api.rollouts.values()
        assert rollout["status"] == "failed" and rollout["metrics"] == {"interrupted": True}
        assert not sleeping(), "the sandbox outlived its trial"
    finally:
        await api.stop()


# Claude Code's default tools are over the tiny model's context (tests/system/test_harness_clis.py);
# Bash alone keeps the prompt inside it.
CLAUDE_DISALLOWED = ("Agent,Task,Glob,Grep,Read,Edit,Write,MultiEdit,NotebookEdit,NotebookRead,"
                     "TodoWrite,WebFetch,WebSearch,BashOutput,KillShell,KillBash,ExitPlanMode,"
                     "EnterPlanMode,Skill,SlashCommand,TaskOutput,TaskStop,AskUserQuestion,LSP,"
                     "ToolSearch,ListMcpResourcesTool,ReadMcpResourceTool,Monitor,CronCreate,"
                     "CronDelete,CronList,EnterWorktree,ExitWorktree")


def offline_agent(gateway, tmp_path: Path, agent: str, model: str,
                  *extra: str) -> tuple[str, dict]:
    """`agent` on the hello-world task in the bwrap environment, with the project's pinned npm
    CLIs and mini-swe-agent's wheels bound read-only (so Harbor skips its network installs):
    the CLI's output and the rollout's state at the gateway."""
    from tests.support.harnesses import NPM_PREFIX, require_harnesses

    bin_dir = require_harnesses()
    if agent == "mini-swe-agent" and not (HARBOR_WHEELS / agent).is_dir():
        pytest.fail(f"{HARBOR_WHEELS / agent} is missing: `make install` downloads it")
    out, states, _ = rollouts(
        gateway, tmp_path, EXAMPLES / "hello-world", agent, "--model", model,
        "--environment-kwarg", f"ro_paths={NPM_PREFIX}:{HARBOR_WHEELS}",
        "--environment-kwarg", f"path={bin_dir}", *extra)
    return out, states["hello-world"]


def websocket_attempts(gateway) -> int:
    """The gateway's access lines of a GET on a model route (a WebSocket upgrade; the
    gateway serves them over HTTP POST only)."""
    from tests.integration.test_access_log import access_lines

    return sum(line["method"] == "GET" and line["route"].endswith("/responses")
               for line in access_lines(gateway))


@needs_harbor
@pytest.mark.parametrize(("agent", "provider", "protocol", "extra"), [
    ("claude-code", "", "anthropic", (
        "--agent-env", "CLAUDE_CODE_MAX_OUTPUT_TOKENS=32",
        "--agent-kwarg", f"disallowed_tools={CLAUDE_DISALLOWED}")),
    ("codex", "", "responses", ()),
    # Harbor's pi takes provider/model and writes its provider block from OPENAI_BASE_URL.
    ("pi", "openai/", "chat", ("--agent-kwarg", "model_api=openai-completions")),
    # Harbor's opencode with an openai/ model speaks the Responses API.
    ("opencode", "openai/", "responses", ()),
    # Installed in the sandbox from the wheels `make install` downloads (litellm inside).
    ("mini-swe-agent", "openai/", "chat", ("--agent-kwarg", "max_tokens=64")),
])
def test_npm_harness_as_a_harbor_agent_offline(gateway, vllm_server, tmp_path, agent, provider,
                                               protocol, extra):
    """A Harbor agent in the bwrap environment, using the project's pinned CLI or wheels
    (bound read-only, so Harbor skips its network install), against the gateway and the tiny
    model: its calls are recorded with the engine's ids and the trial gets Harbor's grade."""
    refused_before = websocket_attempts(gateway)
    out, state = offline_agent(gateway, tmp_path, agent, provider + vllm_server.model, *extra)
    assert state["status"] == "finished" and state["reward"] == 0.0, (state, out)
    # No WebSocket attempt at the Responses API (codex's own provider makes five, issue 38).
    assert websocket_attempts(gateway) == refused_before
    calls = gateway.calls(state["rollout_id"])
    ok = [c for c in calls if c["status"] == "ok"]
    assert ok and all(c["protocol"] == protocol for c in calls), calls
    assert all(c["prompt_ids"] and len(c["logprobs"]) == len(c["completion_ids"]) for c in ok)
    # Merged into traces with tokens to train, as `rolltap bridge` takes any rollout's.
    stats = state["merge"]["stats"]
    assert stats["lost_tokens"] == 0 and stats["trained_tokens"] > 0, stats


@needs_harbor
def test_codex_stopped_by_max_output_tokens_is_judged_by_its_work(vllm_server, database_url,
                                                                  tmp_path):
    """A gateway whose --default-max-tokens binds: the model's reply is an incomplete
    Responses reply, codex exits 1 ("Incomplete response returned"), Harbor would leave the
    trial ungraded. The failure is the model's: the verifier judges the workdir as left (no
    hello.txt: 0.0), never null (issue 38)."""
    import tempfile

    from tests.support.gateway import GatewayProcess

    socket_dir = Path(tempfile.mkdtemp(prefix="rolltap-gw-"))
    gw = GatewayProcess([vllm_server.url], database_url, "--default-max-tokens", "2",
                        "--unix-socket", str(socket_dir / "gateway.sock"),
                        log_path=tmp_path / "gateway.log")
    gw.unix_socket = socket_dir / "gateway.sock"
    gw.start()
    try:
        out, state = offline_agent(gw, tmp_path, "codex", vllm_server.model)
        calls = gw.calls(state["rollout_id"])
        attempts = websocket_attempts(gw)
    finally:
        gw.stop()
        shutil.rmtree(socket_dir, ignore_errors=True)
    assert (state["status"], state["reward"]) == ("finished", 0.0), (state, out)
    assert "NonZeroAgentExitCodeError" in state["metrics"]["harbor_agent_error"], state
    assert calls and all(c["protocol"] == "responses" for c in calls), calls
    assert attempts == 0


@needs_harbor
def test_qwen_coder_starts_offline_and_overflows_the_tiny_models_context(gateway, vllm_server,
                                                                        tmp_path):
    """qwen-coder starts from the pinned CLI and calls the gateway, but its agent turn is
    longer than the tiny model's 32,768-token context: the call is recorded as failed with the
    engine's context-length error and qwen exits 1. The agent failed: where the gateway
    answered one of its calls (a side call may pass) that is the model's doing and the verifier
    judges the workdir (0.0); where it answered none, the rollout is unscorable (issue 38)."""
    out, state = offline_agent(gateway, tmp_path, "qwen-coder", vllm_server.model)
    calls = gateway.calls(state["rollout_id"])
    assert calls and all(c["protocol"] == "chat" for c in calls), calls
    # The agent's turn, recorded as failed with the engine's error.
    failed = [c for c in calls if c["status"] == "failed"]
    assert failed and "maximum context length" in str(failed[0]["error"]), calls
    assert "maximum context length is 32768 tokens" in state["metrics"]["harbor_agent_error"]
    if any(c["status"] == "ok" for c in calls):
        assert (state["status"], state["reward"]) == ("finished", 0.0), (state, out)
    else:
        assert (state["status"], state["reward"]) == ("failed", None), (state, out)
        assert "unscorable: unanswered" in state["metrics"]["reward_detail"]


PODMAN_MISSING = podman.missing(harbor_python())


@needs_harbor
@pytest.mark.skipif(PODMAN_MISSING is not None,
                    reason=f"podman cannot run Harbor trials here: {PODMAN_MISSING}")
def test_podman_environment_passes_through(gateway, vllm_server, base_image, tmp_path,
                                          monkeypatch):
    """Opt-in: where podman works, the same task on Harbor's podman backend scores the same.
    No registry is reachable: rolltap's base image stands in for the task's debian image."""
    monkeypatch.setenv("CONTAINERS_CONF", podman.CONTAINERS_CONF)
    podman.stand_in_slim(base_image)
    _, states, _ = rollouts(gateway, tmp_path, EXAMPLES / "hello-world", "oracle",
                            "--environment", "podman", "--model", vllm_server.model)
    hello = states["hello-world"]
    assert (hello["status"], hello["reward"]) == ("finished", 1.0)
    assert hello["metrics"]["isolation"] == "harbor"


@needs_harbor
def test_terminus_2_keeps_its_tmux_session_across_execs(gateway, vllm_server, tmp_path):
    """Harbor's terminus-2 (on the host, calling the gateway with the rollout's key) starts a
    tmux server in the sandbox in one exec and drives it in later ones: every turn reads the
    pane of the same session, which only a persistent sandbox keeps."""
    out, states, trials = rollouts(
        gateway, tmp_path, EXAMPLES / "hello-world", "terminus-2", "--model",
        f"openai/{vllm_server.model}", "--agent-kwarg", "max_turns=2",
        "--agent-kwarg", "record_terminal_session=false")
    state = states["hello-world"]
    assert state["status"] == "finished" and state["reward"] == 0.0, (state, out)
    assert "harbor_exception" not in state["metrics"], state["metrics"]
    calls = gateway.calls(state["rollout_id"])
    assert len([c for c in calls if c["status"] == "ok"]) >= 2, calls
    # The pane captured after the last turn is the shell the setup exec started in tmux.
    (pane,) = trials.glob("hello-world__*/agent/terminus_2.pane")
    assert "root@sandbox:/app#" in pane.read_text()


# A task image built from its Dockerfile: the build context's file, the RUN step's output and
# the base image's marker are in the sandbox; a file only the host has is not.
IMAGE_CHECKS = """#!/bin/bash
set -e
[ "$(cat /app/data.txt)" = "from the build context" ]
[ "$(cat /app/built.txt)" = "made by RUN" ]
grep -q "rolltap base image" /{marker}
[ ! -e {host_only} ]
"""


def image_task(root: Path, base: str, host_only: str) -> Path:
    task = root / "image-task"
    shutil.copytree(EXAMPLES / "hello-world", task)
    env = task / "environment"
    (env / "Dockerfile").write_text(
        f"FROM {base}\nWORKDIR /app\nCOPY data.txt /app/data.txt\n"
        f"RUN echo 'made by RUN' > /app/built.txt\n")
    (env / "data.txt").write_text("from the build context\n")
    checks = IMAGE_CHECKS.format(marker=images.BASE_MARKER, host_only=host_only)
    (task / "solution" / "solve.sh").write_text(
        checks + 'echo "Hello, world!" > /app/hello.txt\n')
    (task / "tests" / "test.sh").write_text(
        checks.replace("set -e", "set -e\necho 0 > /logs/verifier/reward.txt")
        + '[ "$(cat /app/hello.txt)" = "Hello, world!" ]\necho 1 > /logs/verifier/reward.txt\n')
    missing = root / "missing-image"
    shutil.copytree(EXAMPLES / "hello-world", missing)
    shutil.rmtree(missing / "environment")
    toml = missing / "task.toml"
    toml.write_text(toml.read_text().replace(
        "[environment]\n", '[environment]\ndocker_image = "localhost/rolltap-missing:none"\n'))
    return task


@needs_harbor
def test_bwrap_environment_runs_the_tasks_own_image(gateway, base_image, tmp_path):
    """The task's Dockerfile (FROM the offline base image, a COPY and a RUN) is built by
    buildah and is the trial's root: the oracle's solve.sh and the verifier's test.sh see the
    copied file, the RUN step's output and the image's marker, not the host's bwrap. What the
    trial wrote stays out of the image cache. An image that is neither stored nor pullable
    (offline) leaves its trial unscorable, with the cause."""
    host_only = shutil.which("bwrap")
    assert host_only
    task = image_task(tmp_path / "tasks", base_image, host_only)
    started = time.monotonic()
    out, states, _ = rollouts(gateway, tmp_path, tmp_path / "tasks", "oracle", rootfs="image")
    print(f"two image trials (first build included): {time.monotonic() - started:.1f} s")
    state = states["image-task"]
    assert (state["status"], state["reward"]) == ("finished", 1.0), (state, out)
    missing = states["missing-image"]
    assert (missing["status"], missing["reward"]) == ("failed", None), missing
    assert "localhost/rolltap-missing:none" in missing["metrics"]["harbor_exception"]
    assert "rolltap image prepare" in missing["metrics"]["harbor_exception"]
    built = images.inspect(images.load_build(str(task / "environment")).tag)
    rootfs = Path(images.Cache().rootfs(built.digest))
    assert (rootfs / "app" / "built.txt").is_file()
    assert not (rootfs / "app" / "hello.txt").exists(), "a trial's write reached the cache"
    # Warm: the image is built and unpacked; one trial's time end to end through the CLI.
    shutil.rmtree(tmp_path / "tasks" / "missing-image")
    (tmp_path / "warm").mkdir()
    started = time.monotonic()
    _, states, _ = rollouts(gateway, tmp_path / "warm", tmp_path / "tasks", "oracle",
                            rootfs="image")
    warm = states["image-task"]
    print(f"one image trial, warm: {time.monotonic() - started:.1f} s through the CLI; "
          f"Harbor's phases (s): {warm['metrics'].get('harbor_phases_s')}")
    assert warm["reward"] == 1.0


@needs_harbor
def test_image_sandbox_reaches_only_the_gateway_with_its_key(gateway, base_image, tmp_path):
    """The probe task on its own image (FROM the base image): the gateway forwarder (the
    host's socat, run by the host's loader) serves the rollout's key and nothing else, as on
    the host's directories."""
    task = tmp_path / "tasks" / "probe"
    shutil.copytree(FIXTURES / "probe", task)
    (task / "environment" / "Dockerfile").write_text(f"FROM {base_image}\nWORKDIR /app\n")
    _, states, _ = rollouts(gateway, tmp_path, tmp_path / "tasks", "oracle", rootfs="image")
    probe_reached_only_the_gateway(gateway, states["probe"])
