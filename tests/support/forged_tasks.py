"""Terminal-Bench-style Harbor tasks whose graded code forges its verdict (issue 38).

Each task asks for /app/solution.py with `add(a, b)`; its tests/test.sh runs
`python3 -m pytest -q /tests/test_solution.py` from the workdir and writes reward 1 when the
exit status is 0 (and a second reward key, `checked`, that reaches the metrics). The oracle
(solution/solve.sh) is the honest right answer; each task's instruction.md is the bash script
that ShellAgent (tests/support/harbor_agents.py) runs as its attempt: an honest wrong answer, a
forgery from the issue's table, or a variant of our own.
"""

from __future__ import annotations

import shutil
from pathlib import Path

WRONG = "def add(a, b):\n    return a - b\n"
RIGHT = "def add(a, b):\n    return a + b\n"

TESTS = """from solution import add


def test_small():
    assert add(1, 2) == 3


def test_negative():
    assert add(-4, 1) == -3


def test_zero():
    assert add(0, 0) == 0
"""

# {pythonpath}: where pytest is on a rootfs without it (the host's system Python has none).
TEST_SH = """#!/bin/bash
{pythonpath}
cd /app
python3 -m pytest -q /tests/test_solution.py
status=$?
echo "{{\\"reward\\": $([ $status -eq 0 ] && echo 1 || echo 0), \\"checked\\": 1}}" \\
  > /logs/verifier/reward.json
"""

# name -> files the attempt writes in /app (the table's rows, then variants of our own).
ATTEMPTS: dict[str, dict[str, str]] = {
    "honest-wrong": {"solution.py": WRONG},
    "honest-right": {"solution.py": RIGHT},
    "os-exit": {"solution.py": "import os\nos._exit(0)\n"},
    "runtest-noop": {"solution.py": "import _pytest.python\n"
                     "_pytest.python.Function.runtest = lambda self: None\n" + WRONG},
    "pytest-exit": {"solution.py": "import pytest\n\n\ndef add(a, b):\n"
                    "    pytest.exit('unsure', returncode=0)\n"},
    "shadow-pytest": {"solution.py": WRONG, "pytest.py": "import sys\nsys.exit(0)\n"},
    "conftest-skip": {"solution.py": WRONG, "conftest.py":
                      "import pytest\n\n\ndef pytest_runtest_setup(item):\n"
                      "    pytest.skip('no')\n"},
    # Variants: after the report, at exit, in a thread, through pytest's reports and hooks,
    # through the report channel, the interpreter's start-up hooks and the process itself.
    "atexit-exit": {"solution.py": "import atexit, os\natexit.register(os._exit, 0)\n" + WRONG},
    "sys-exit-patched": {"solution.py": "import sys\nsys.exit = lambda *a: None\n"
                         "import builtins\nbuiltins.exit = lambda *a: None\n" + WRONG},
    "thread-exit": {"solution.py": "import os, threading, time\n"
                    "threading.Thread(target=lambda: (time.sleep(0.3), os._exit(0)), "
                    "daemon=True).start()\n"
                    "def add(a, b):\n    time.sleep(1)\n    return a - b\n"},
    "reports-passed": {"solution.py": "import _pytest.reports\n"
                       "_init = _pytest.reports.TestReport.__init__\n"
                       "def init(self, *a, **k):\n    _init(self, *a, **k)\n"
                       "    self.outcome = 'passed'\n"
                       "_pytest.reports.TestReport.__init__ = init\n" + WRONG},
    "deselect-all": {"solution.py": "import gc\nfrom _pytest.config import Config\n"
                     "class Drop:\n    def pytest_collection_modifyitems(self, items):\n"
                     "        items[:] = []\n"
                     "for o in gc.get_objects():\n    if isinstance(o, Config):\n"
                     "        o.pluginmanager.register(Drop())\n" + WRONG},
    "report-fd": {"solution.py": "import os\nfor fd in os.listdir('/proc/self/fd'):\n"
                  "    try:\n        os.write(int(fd), b'rolltap-report {\"record\": \"end\"}"
                  " 00\\n')\n    except OSError:\n        pass\nos._exit(0)\n"},
    "kill-self": {"solution.py": "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n"},
    "exec-true": {"solution.py": "import os\nos.execv('/bin/true', ['true'])\n"},
    "sitecustomize": {"solution.py": WRONG,
                      "sitecustomize.py": "import atexit, os\natexit.register(os._exit, 0)\n",
                      "usercustomize.py": "import atexit, os\natexit.register(os._exit, 0)\n"},
    "pth-and-pytest-pkg": {"solution.py": WRONG, "hack.pth": "import os; os._exit(0)\n",
                           "pytest/__init__.py": "import sys\nsys.exit(0)\n",
                           "pytest/__main__.py": "import sys\nsys.exit(0)\n"},
}


def attempt_script(files: dict[str, str]) -> str:
    """The bash script that writes `files` under /app (quoted heredocs: bytes as given)."""
    lines = ["set -e", "mkdir -p /app"]
    for name, text in files.items():
        parent = str(Path("/app", name).parent)
        lines += [f"mkdir -p {parent}", f"cat > /app/{name} <<'ROLLTAP_EOF'", text.rstrip("\n"),
                  "ROLLTAP_EOF"]
    return "\n".join(lines) + "\n"


def forged_task(root: Path, name: str, files: dict[str, str], *, pythonpath: str = "",
                oracle_is_attempt: bool = False, base_image: str | None = None) -> Path:
    """One task under `root`: the attempt in instruction.md, the honest right answer as the
    oracle (or the attempt itself, `oracle_is_attempt`, as the issue's table ran it)."""
    task = root / name
    if task.exists():
        shutil.rmtree(task)
    (task / "tests").mkdir(parents=True)
    (task / "solution").mkdir()
    (task / "environment").mkdir()
    (task / "task.toml").write_text(
        'schema_version = "1.4"\n\n[verifier]\ntimeout_sec = 120.0\n\n[agent]\n'
        'timeout_sec = 120.0\n\n[environment]\nbuild_timeout_sec = 600.0\nworkdir = "/app"\n')
    (task / "instruction.md").write_text(attempt_script(files))
    oracle = files if oracle_is_attempt else {"solution.py": RIGHT}
    (task / "solution" / "solve.sh").write_text("#!/bin/bash\n" + attempt_script(oracle))
    (task / "tests" / "test_solution.py").write_text(TESTS)
    export = f"export PYTHONPATH={pythonpath}" if pythonpath else ""
    (task / "tests" / "test.sh").write_text(TEST_SH.format(pythonpath=export))
    (task / "environment" / "Dockerfile").write_text(
        f"FROM {base_image or 'debian:bookworm-slim'}\nWORKDIR /app\n")
    return task


PYTEST_PACKAGES = ("pytest", "_pytest", "pluggy", "iniconfig", "packaging", "pygments", "py.py")


def pytest_lib(where: Path) -> Path:
    """pytest and what it imports, copied from this interpreter's site-packages (pure Python)
    for a rootfs whose Python has no pytest (the host's system Python here)."""
    import pytest

    site = Path(pytest.__file__).resolve().parents[1]
    where.mkdir(parents=True, exist_ok=True)
    for name in PYTEST_PACKAGES:
        source = site / name
        if source.is_dir():
            shutil.copytree(source, where / name, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("__pycache__"))
        elif source.is_file():
            shutil.copy(source, where / name)
    return where
