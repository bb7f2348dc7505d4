"""Harbor tasks graded by their own test.sh, whose graded code tries to forge the verdict
(issue 38): tests/support/forged_tasks.py's attempts, run by ShellAgent through
`rolltap rollouts DIR --harness harbor:...` on the bwrap environment."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.support.forged_tasks import ATTEMPTS, forged_task, pytest_lib
from tests.support.harbor import REPO, needs_harbor, rollouts

SHELL_AGENT = "tests.support.harbor_agents:ShellAgent"
EXAMPLES = REPO / "examples" / "harbor"
# Outside /tmp and /root, which the verifier's view makes afresh; `build/` is ignored by git.
PYTEST_LIB = REPO / "build" / "harbor-pytest"


def run_attempts(gateway, tmp_path: Path, *, oracle_is_attempt: bool = False,
                 names=tuple(ATTEMPTS)) -> tuple[str, dict[str, dict]]:
    lib = pytest_lib(PYTEST_LIB)
    tasks = tmp_path / "tasks"
    for name in names:
        forged_task(tasks, name, ATTEMPTS[name], pythonpath=str(lib),
                    oracle_is_attempt=oracle_is_attempt)
    agent = "oracle" if oracle_is_attempt else SHELL_AGENT
    out, states, _ = rollouts(gateway, tmp_path, tasks, agent,
                              "--environment-kwarg", f"ro_paths={lib}")
    return out, states


def assert_sealed(states: dict[str, dict]) -> None:
    """The honest right answer keeps 1.0 (and its other reward key); the honest wrong one
    scores 0; no forgery scores more, and one that fooled test.sh is `tampered`."""
    right = states["honest-right"]
    assert (right["status"], right["reward"]) == ("finished", 1.0), right
    assert right["metrics"]["harbor_rewards"] == {"checked": 1.0}
    assert right["metrics"]["harbor_seal"] == "sealed: 3/3 expected tests passed"
    wrong = states["honest-wrong"]["reward"]
    assert wrong == 0.0, states["honest-wrong"]
    for name, state in states.items():
        if name == "honest-right":
            continue
        assert state["status"] == "finished" and state["reward"] <= wrong, (name, state)
        fooled = state["metrics"]["harbor_seal"].startswith("test.sh gave 1")
        assert (state["metrics"]["sandbox_status"] == "tampered") == fooled, (name, state)


@needs_harbor
def test_no_forged_verdict_outscores_the_honest_wrong_answer(gateway, tmp_path):
    """Every attempt (the issue's table and our variants) on the bwrap environment, on the
    host's system directories. Collection runs once per task on the oracle's files."""
    out, states = run_attempts(gateway, tmp_path)
    assert_sealed(states)
    assert "verdict unsealed" not in out
    trials = list((tmp_path / f"trials-{SHELL_AGENT}" / "collect").glob("*__collect"))
    assert len(trials) == len(ATTEMPTS), trials


TABLE = ("honest-wrong", "honest-right", "os-exit", "runtest-noop", "pytest-exit",
         "shadow-pytest", "conftest-skip", "atexit-exit", "report-fd")


@needs_harbor
def test_forged_verdicts_on_the_tasks_own_image(gateway, base_image, tmp_path):
    """The table's rows on a task image (FROM the base image, whose Python has pytest): the
    seal directory is in the view whatever the root filesystem."""
    tasks = tmp_path / "tasks"
    for name in TABLE:
        forged_task(tasks, name, ATTEMPTS[name], base_image=base_image)
    _, states, _ = rollouts(gateway, tmp_path, tasks, SHELL_AGENT, rootfs="image")
    assert_sealed(states)


@needs_harbor
def test_a_verifier_without_pytest_is_said_to_be_unsealed(gateway, tmp_path):
    """examples/harbor/hello-world's test.sh compares a file: its reward stands, and the run's
    summary says the tested code could change it."""
    out, states, _ = rollouts(gateway, tmp_path, EXAMPLES / "hello-world", "oracle")
    assert states["hello-world"]["reward"] == 1.0
    assert "hello-world: verdict unsealed: the tested code can change it" in out


# The agent's work, then one model call through the gateway (or none), then exit 1.
FAILING_AGENT = """echo "Hello, world!" > /app/hello.txt
{call}
exit 1
"""
CALL = """python3 - <<'PY'
import json, os, urllib.request
base, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
def call(url, body=None):
    req = urllib.request.Request(url, data=json.dumps(body).encode() if body else None,
                                 headers={"Authorization": f"Bearer {key}",
                                          "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)
model = call(base + "/models")["data"][0]["id"]
call(base + "/chat/completions", {"model": model, "max_tokens": 4,
                                  "messages": [{"role": "user", "content": "hi"}]})
PY"""


@needs_harbor
def test_an_agent_that_exits_1_is_judged_by_its_work(gateway, tmp_path):
    """An agent that wrote the right answer, made a call the gateway answered, and exited 1
    scores what the verifier gives (1.0), never null; one that failed before the gateway
    answered anything is unscorable (issue 38)."""
    tasks = tmp_path / "tasks"
    for name, call in (("answered", CALL), ("unanswered", "")):
        task = tasks / name
        shutil.copytree(EXAMPLES / "hello-world", task)
        (task / "instruction.md").write_text(FAILING_AGENT.format(call=call))
    out, states, _ = rollouts(gateway, tmp_path, tasks, SHELL_AGENT)
    answered = states["answered"]
    assert (answered["status"], answered["reward"]) == ("finished", 1.0), (answered, out)
    assert "RuntimeError: the attempt's script failed" in answered["metrics"][
        "harbor_agent_error"]
    assert [c["status"] for c in gateway.calls(answered["rollout_id"])] == ["ok"]
    unanswered = states["unanswered"]
    assert (unanswered["status"], unanswered["reward"]) == ("failed", None), unanswered
    assert "unscorable: 1 of 2 (unanswered: 1)" in out
