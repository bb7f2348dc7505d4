"""rolltap's seal on a Harbor task's test.sh, without Harbor (issue 38): the seal directory's
shims and launcher (sandbox/harbor/seal.py), real bash, the host's Python and pytest, the pipes
passed as the bwrap environment passes them (tests/support/seal_run.py). Every attempt of
tests/support/forged_tasks.py: test.sh's reward stands only where the sealed report bears it
out, so no forgery scores more than the honest wrong answer, and the honest right one keeps
its 1."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from sandbox.harbor.seal import sealed_reward
from tests.support.forged_tasks import ATTEMPTS, RIGHT, TEST_SH, TESTS
from tests.support.seal_run import install, run_sealed

SITE = str(Path(pytest.__file__).resolve().parents[1])  # the host's Python has no pytest


def task(root: Path, files: dict[str, str]) -> Path:
    """The forged task's files at `root` (its /app, /tests and /logs/verifier)."""
    shutil.rmtree(root, ignore_errors=True)
    for sub in ("app", "tests", "logs"):
        (root / sub).mkdir(parents=True)
    (root / "tests" / "test_solution.py").write_text(TESTS)
    script = TEST_SH.format(pythonpath=f"export PYTHONPATH={SITE}")
    script = (script.replace("cd /app", f"cd {root}/app")
              .replace("/tests/", f"{root}/tests/").replace("/logs/verifier", f"{root}/logs"))
    (root / "tests" / "test.sh").write_text(script)
    for name, text in files.items():
        (root / "app" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "app" / name).write_text(text)
    return root


@pytest.fixture(scope="module")
def sealed(tmp_path_factory):
    """The seal directory and the task's expected tests, collected on the oracle's files."""
    where = tmp_path_factory.mktemp("seal")
    seal_dir = install(where / "seal")
    oracle = task(where / "oracle", {"solution.py": RIGHT})
    report, _, out = run_sealed(seal_dir, oracle / "tests" / "test.sh", oracle / "app",
                                collect=True)
    assert report.problem is None and report.runs == 1, (report, out)
    return seal_dir, report


@pytest.mark.parametrize("name", list(ATTEMPTS))
def test_no_forgery_scores_more_than_the_honest_wrong_answer(sealed, tmp_path, name):
    seal_dir, collected = sealed
    root = task(tmp_path / name, ATTEMPTS[name])
    report, _, out = run_sealed(seal_dir, root / "tests" / "test.sh", root / "app",
                                expected=collected.expected)
    rewards = json.loads((root / "logs" / "reward.json").read_text())
    reward, tampered, detail = sealed_reward(float(rewards["reward"]), report, True)
    assert rewards["checked"] == 1  # the task's other keys are test.sh's, untouched
    if name == "honest-right":
        assert (reward, tampered) == (1.0, False), (report, out)
        assert report.passed == report.total == 3
    else:
        assert reward == 0.0, (name, report, detail, out)
        # Where test.sh was fooled into a pass, the rollout is marked tampered.
        assert tampered == (rewards["reward"] == 1), (name, report, detail, out)


def test_a_task_whose_verifier_runs_no_pytest_is_unsealed(sealed, tmp_path):
    seal_dir, _ = sealed
    root = task(tmp_path / "checker", {"solution.py": RIGHT})
    (root / "tests" / "test.sh").write_text(f"cd {root}/app && python3 -c 'import solution'\n")
    report, code, out = run_sealed(seal_dir, root / "tests" / "test.sh", root / "app",
                                   collect=True)
    assert code == 0 and report.runs == 0 and report.problem is None, out


def test_pythons_other_commands_run_as_they_would(sealed, tmp_path):
    """The shims change only pytest's runs: python3 -c, a script, -m of another module."""
    seal_dir, _ = sealed
    root = task(tmp_path / "plain", {"solution.py": RIGHT})
    (root / "tests" / "test.sh").write_text(
        f"cd {root}/app\npython3 -c 'import solution; print(solution.add(2, 3))'\n"
        "python3 -m json.tool <<< '[1]'\npython3 -B -c 'import sys; print(sys.flags.isolated)'\n")
    _, code, out = run_sealed(seal_dir, root / "tests" / "test.sh", root / "app", collect=True)
    assert code == 0 and out.split() == ["5", "[", "1", "]", "0"], out
