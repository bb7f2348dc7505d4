"""The seal on a Harbor task's pytest runs (issue 38): what it adds to a trial's verifier.

A Terminal-Bench-style test.sh (`python3 -m pytest -q` on three tests, then reward.json) on the
host, run N times plainly and N times under the seal as the bwrap environment's verifier runs
it (sandbox/harbor/seal.py's shims and launcher, the setup and report pipes, hidden sentinels),
then judged, alternately. The seal's cost per trial: the difference of the fastest runs (the
least disturbed by other load), plus writing the seal
directory's files and judging the report. Goal: under 0.3 s. The collection trial (once per
task, not per trial) is not in it.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.support.forged_tasks import RIGHT, TEST_SH, TESTS
from tests.support.seal_run import PATH, install, run_sealed

RUNS = 7
GOAL_S = 0.3


def _task(root: Path) -> Path:
    site = str(Path(pytest.__file__).resolve().parents[1])
    for sub in ("app", "tests", "logs"):
        (root / sub).mkdir(parents=True)
    (root / "app" / "solution.py").write_text(RIGHT)
    (root / "tests" / "test_solution.py").write_text(TESTS)
    script = (TEST_SH.format(pythonpath=f"export PYTHONPATH={site}")
              .replace("cd /app", f"cd {root}/app").replace("/tests/", f"{root}/tests/")
              .replace("/logs/verifier", f"{root}/logs"))
    (root / "tests" / "test.sh").write_text(script)
    return root


def run(print_fn=print) -> None:
    with tempfile.TemporaryDirectory(prefix="rolltap-bench-seal-") as where:
        root = _task(Path(where) / "task")
        started = time.perf_counter()
        seal_dir = install(Path(where) / "seal")
        install_s = time.perf_counter() - started
        collected, _, out = run_sealed(seal_dir, root / "tests" / "test.sh", root / "app",
                                       collect=True)
        assert collected.runs == 1, out
        plain, sealed = [], []
        for _ in range(RUNS):
            started = time.perf_counter()
            subprocess.run(["bash", str(root / "tests" / "test.sh")], cwd=root / "app",
                           env={"PATH": PATH, "HOME": where}, capture_output=True, check=False)
            plain.append(time.perf_counter() - started)
            started = time.perf_counter()
            report, _, out = run_sealed(seal_dir, root / "tests" / "test.sh", root / "app",
                                        expected=collected.expected)
            sealed.append(time.perf_counter() - started)
            assert report.problem is None and report.passed == 3, out
    cost = max(0.0, min(sealed) - min(plain)) + install_s
    print_fn(f"Harbor test.sh (python3 -m pytest, 3 tests), {RUNS} runs each on "
             f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}:")
    print_fn(f"  plain: fastest {min(plain):.3f} s, median {statistics.median(plain):.3f} s; "
             f"sealed (judged): fastest {min(sealed):.3f} s, median "
             f"{statistics.median(sealed):.3f} s; seal directory written in "
             f"{install_s * 1000:.1f} ms")
    print_fn(f"  sealing cost per trial: {cost:.3f} s (goal < {GOAL_S} s): "
             f"{'ok' if cost < GOAL_S else 'OVER'}")
