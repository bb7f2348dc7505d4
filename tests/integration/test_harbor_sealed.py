"""Harbor tasks graded by their own test.sh, whose graded code tries to forge the verdict
(issue 38): tests/support/forged_tasks.py's attempts, run by ShellAgent through
`rolltap rollouts DIR --harness harbor:...` on the bwrap environment."""

from __future__ import annotations

from pathlib import Path

from tests.support.forged_tasks import ATTEMPTS, forged_task, pytest_lib
from tests.support.harbor import REPO, needs_harbor, rollouts

SHELL_AGENT = "tests.support.harbor_agents:ShellAgent"
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


@needs_harbor
def test_repro_table(gateway, tmp_path):
    out, states = run_attempts(gateway, tmp_path, oracle_is_attempt=True)
    print(out)
    for name, s in sorted(states.items()):
        print("REPRO", name, s["status"], s["reward"], s["metrics"].get("harbor_rewards"),
              s.get("reward_detail") or s["metrics"].get("reward_detail"))
