"""The packages' dependency direction (pyproject.toml, [tool.importlinter]) holds: the gateway
imports neither other package, the sandbox reaches the gateway only over HTTP, and the bridge uses
only the gateway's store and the helpers listed, and the gateway's own modules keep their layers
(serve > app > routes > runtime > pipeline > its stages > protocols, upstream > store). Kept by
`make test` as well as `make lint`."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The venv's console script: import-linter set up in this process would configure logging for
# the whole test session (it silences the loggers other tests read through caplog).
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def test_packages_keep_their_import_contracts():
    done = subprocess.run([str(LINT_IMPORTS), str(REPO / "pyproject.toml"), "--no-cache",
                           "--no-logo"], cwd=REPO, capture_output=True, text=True, timeout=300)
    report = done.stdout + done.stderr
    assert done.returncode == 0, f"an import breaks the packages' contracts:\n{report}"
    # Every contract declared was checked (none skipped as unreadable).
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    assert f"Contracts: {len(declared['contracts'])} kept, 0 broken." in report
