"""The packages' dependency direction (pyproject.toml, [tool.importlinter]) holds: the gateway
imports neither other package, the sandbox reaches the gateway only over HTTP, and the bridge uses
only the gateway's store and the helpers listed. Kept by `make test` as well as `make lint`."""

from __future__ import annotations

from pathlib import Path

from importlinter.cli import lint_imports

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_packages_keep_their_import_contracts(capsys):
    failed = lint_imports(config_filename=str(PYPROJECT), no_cache=True, no_logo=True)
    report = capsys.readouterr().out
    assert not failed, f"an import breaks the packages' contracts:\n{report}"
    assert "Contracts: 3 kept, 0 broken." in report
