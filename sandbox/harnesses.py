"""The pinned harness CLIs from npm (`rolltap harnesses install`, `make harnesses`): installed
into the repository's `.cache/npm/`, where the test suite and Harbor's npm agents offline (the
bwrap environment's `ro_paths`/`path` kwargs) find them. One `package.json` pins every harness;
the install runs under a file lock and is redone only when an installed version differs from
its pin.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import shutil
import subprocess
import sys
from pathlib import Path

from sandbox.presets import NPM_EXECUTABLES

REPO = Path(__file__).resolve().parents[1]
NPM_PREFIX = REPO / ".cache" / "npm"
INSTALL_TIMEOUT_S = 900.0

# preset name -> (npm package, pinned version): the versions the compatibility table lists.
HARNESS_PACKAGES: dict[str, tuple[str, str]] = {
    "claude-code": ("@anthropic-ai/claude-code", "2.1.197"),
    "codex": ("@openai/codex", "0.171.0"),
    "opencode": ("opencode-ai", "1.18.33"),
    "qwen-code": ("@qwen-code/qwen-code", "0.15.10"),
    "pi": ("@mariozechner/pi-coding-agent", "0.73.1"),
}


def harness_bin_dir(prefix: Path = NPM_PREFIX) -> Path:
    return prefix / "node_modules" / ".bin"


def installed_versions(prefix: Path = NPM_PREFIX) -> dict[str, str | None]:
    """preset -> the version installed under `prefix` (None if missing or its CLI is absent)."""
    out: dict[str, str | None] = {}
    for preset, (package, _) in HARNESS_PACKAGES.items():
        manifest = prefix / "node_modules" / package / "package.json"
        exe = harness_bin_dir(prefix) / NPM_EXECUTABLES[preset]
        try:
            version = json.loads(manifest.read_text())["version"]
        except (OSError, ValueError, KeyError):
            version = None
        out[preset] = version if exe.exists() else None
    return out


def _up_to_date(prefix: Path) -> bool:
    have = installed_versions(prefix)
    return all(have[p] == version for p, (_, version) in HARNESS_PACKAGES.items())


def ensure_harnesses(prefix: Path = NPM_PREFIX) -> Path:
    """Install the pinned harnesses under `prefix` unless they already are; returns the bin
    directory. Safe to call from concurrent sessions (a lock file serialises installs)."""
    if _up_to_date(prefix):
        return harness_bin_dir(prefix)
    npm = shutil.which("npm")
    if npm is None:
        raise FileNotFoundError("npm is not installed (Node.js 20 or newer with npm is needed)")
    prefix.mkdir(parents=True, exist_ok=True)
    with open(prefix / ".install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _up_to_date(prefix):  # another session installed them while this one waited
            return harness_bin_dir(prefix)
        manifest = {
            "name": "rolltap-test-harnesses",
            "private": True,
            "dependencies": {pkg: version for pkg, version in HARNESS_PACKAGES.values()},
        }
        (prefix / "package.json").write_text(json.dumps(manifest, indent=2) + "\n")
        proc = subprocess.run(
            [npm, "install", "--no-audit", "--no-fund", "--no-update-notifier", "--loglevel=error"],
            cwd=prefix,
            capture_output=True,
            text=True,
            timeout=INSTALL_TIMEOUT_S,
        )
        if proc.returncode != 0 or not _up_to_date(prefix):
            raise RuntimeError(
                f"npm install in {prefix} failed ({proc.returncode}); installed: "
                f"{installed_versions(prefix)}\n{proc.stderr[-3000:]}"
            )
    return harness_bin_dir(prefix)



def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "harnesses", help="install the pinned harness CLIs (claude-code, codex, opencode, "
        "qwen-code, pi) into .cache/npm, for offline runs", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="harnesses_command", metavar="ACTION", required=True)
    install = sub.add_parser("install", help="npm install the pinned versions (needs Node.js "
                             ">= 20 with npm, and the npm registry, once)")
    install.set_defaults(func=_install)
    listing = sub.add_parser("list", help="the pinned and the installed versions")
    listing.set_defaults(func=_list)


def _install(args: argparse.Namespace) -> int:
    print(f"installing {len(HARNESS_PACKAGES)} pinned harness CLIs into {NPM_PREFIX} ...",
          flush=True)
    try:
        bin_dir = ensure_harnesses()
    except (FileNotFoundError, RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"rolltap harnesses install: {exc}", file=sys.stderr)
        return 1
    _list(args)
    print(f"their commands: {bin_dir}\nHarbor's npm agents offline: --environment-kwarg "
          f"ro_paths={NPM_PREFIX} --environment-kwarg path={bin_dir}")
    return 0


def _list(args: argparse.Namespace) -> int:
    have = installed_versions()
    for preset, (package, version) in HARNESS_PACKAGES.items():
        print(f"{preset:12} {package}@{version}: {have[preset] or 'not installed'}")
    return 0 if all(have[p] == v for p, (_, v) in HARNESS_PACKAGES.items()) else 1
