"""A Harbor task's test.sh run under rolltap's seal on this host, without Harbor: the seal
directory (sandbox/harbor/seal.py) at a path of the test's, its pipes passed as the bwrap
environment's verifier execs pass them. Real processes: bash, the shims, the launcher, pytest."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from sandbox.harbor import seal
from sandbox.harbor.protocol import SealReport
from sandbox.verifier import drain

PATH = "/usr/local/bin:/usr/bin:/bin"


def install(where: Path) -> Path:
    for rel, (mode, text) in seal.view_files(str(where)).items():
        path = where / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        path.chmod(mode)
    return where


def run_sealed(seal_dir: Path, script: Path, cwd: Path, *, collect: bool = False,
               expected: list[list[str]] | None = None, stub: bool = False,
               env: dict[str, str] | None = None) -> tuple[SealReport, int, str]:
    """(the seal's report, test.sh's exit status, its output)."""
    setups, lines = seal.make_setups(collect, stub)
    key_r, key_w = os.pipe()
    os.write(key_w, lines)
    os.close(key_w)
    report_r, report_w = os.pipe()
    full = {"PATH": seal.path(PATH, str(seal_dir)), "HOME": str(cwd),
            **seal.env(key_r, report_w), **(env or {})}
    try:
        proc = subprocess.run(["bash", str(script)], cwd=cwd, env=full, pass_fds=(key_r, report_w),
                              capture_output=True, text=True, timeout=300)
    finally:
        os.close(key_r)
        os.close(report_w)
    channel = drain(report_r)
    os.close(report_r)
    report = (seal.collect_report(channel, setups) if collect else
              seal.judge_report(channel, setups, expected or []))
    return report, proc.returncode, proc.stdout + proc.stderr
