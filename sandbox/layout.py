"""The directory tree and the environment of one sandbox.

    <root>/work    the agent's working directory (task files, later the hidden tests)
    <root>/home    HOME, with the XDG config/cache/data/state directories inside
    <root>/tmp     TMPDIR

The environment is built from nothing: whatever the runner holds (admin key, cloud
credentials, tokens) never reaches the harness or the verifier.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path, PurePosixPath

import msgspec

from sandbox.tasks import check_relative_path

# Tools that consult an npm registry (OpenCode fetches plugins at every start) must fail fast
# instead of reaching the internet: nothing listens on the discard port of the loopback.
UNREACHABLE_REGISTRY = "http://127.0.0.1:9/"


class SandboxDirs(msgspec.Struct, frozen=True):
    root: str
    work: str
    home: str
    tmp: str

    @property
    def xdg(self) -> dict[str, str]:
        return {
            "XDG_CONFIG_HOME": f"{self.home}/.config",
            "XDG_CACHE_HOME": f"{self.home}/.cache",
            "XDG_DATA_HOME": f"{self.home}/.local/share",
            "XDG_STATE_HOME": f"{self.home}/.local/state",
        }


def sandbox_parent(root: str | None) -> str:
    """The directory sandboxes are made in: `root`, or by default one in the temp dir shared
    by every sandbox of this user on the machine (every run, every Ray worker), so that hiding
    it from an agent hides all of its siblings."""
    if root is not None:
        os.makedirs(root, mode=0o700, exist_ok=True)
        return root
    parent = os.path.join(tempfile.gettempdir(), f"rolltap-sandboxes-{os.geteuid()}")
    os.makedirs(parent, mode=0o700, exist_ok=True)
    st = os.lstat(parent)
    # The temp dir is everyone's: a directory planted there by another user must not be used.
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise RuntimeError(f"{parent} is not a private directory of this user; give a root")
    return parent


def make_dirs(parent: str | None, label: str) -> SandboxDirs:
    root = tempfile.mkdtemp(prefix=f"rolltap-{label}-", dir=parent)
    dirs = SandboxDirs(root=root, work=f"{root}/work", home=f"{root}/home", tmp=f"{root}/tmp")
    for path in (dirs.work, dirs.tmp, *dirs.xdg.values()):
        os.makedirs(path, mode=0o700, exist_ok=True)
    return dirs


def verifier_dirs(dirs: SandboxDirs) -> SandboxDirs:
    """Same workdir, new HOME and TMPDIR: what the agent left in its HOME (a user
    site-packages with a .pth file, tool configs) must not run inside the verifier."""
    fresh = SandboxDirs(
        root=dirs.root, work=dirs.work, home=f"{dirs.root}/verifier-home",
        tmp=f"{dirs.root}/verifier-tmp",
    )
    for path in (fresh.tmp, *fresh.xdg.values()):
        os.makedirs(path, mode=0o700, exist_ok=True)
    return fresh


def remove_dirs(dirs: SandboxDirs) -> None:
    # An agent may leave directories without write or search permission behind.
    def unlock(func, path, _exc):
        for p in (os.path.dirname(path), path):
            if os.path.isdir(p) and not os.path.islink(p):
                os.chmod(p, stat.S_IRWXU)
        func(path)

    if sys.version_info >= (3, 12):
        shutil.rmtree(dirs.root, onexc=unlock)
    else:
        shutil.rmtree(dirs.root, onerror=unlock)


def _clear(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def _check_names(files: Mapping[str, bytes]) -> None:
    for name in files:
        if problem := check_relative_path(name):
            raise ValueError(f"{name!r}: {problem}")


def _ensure_dir(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        _clear(path)
        path.mkdir()


def write_files(base: str, files: Mapping[str, bytes]) -> None:
    """Write `files` under `base` without ever following a symlink out of it.

    Used for the hidden tests after the agent ran: the agent may have planted a symlink at a
    test's path (or at one of its parent directories) to have them written elsewhere, or a
    directory where a file goes. Whatever is in the way is removed first.
    """
    root = Path(base)
    _check_names(files)
    _ensure_dir(root)
    for name, content in files.items():
        parts = PurePosixPath(name).parts
        current = root
        for part in parts[:-1]:
            current = current / part
            if current.is_symlink() or (current.exists() and not current.is_dir()):
                _clear(current)
            current.mkdir(exist_ok=True)
        target = current / parts[-1]
        if target.is_symlink() or target.exists():
            _clear(target)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as fh:
            fh.write(content)


def replace_files(base: str, files: Mapping[str, bytes]) -> None:
    """Like write_files, but every top-level directory named in `files` is first removed as a
    whole: hidden tests in `tests_hidden/` must not run next to a conftest.py the agent planted
    in a directory of that name."""
    _check_names(files)
    _ensure_dir(Path(base))
    tops = {PurePosixPath(name).parts[0] for name in files if len(PurePosixPath(name).parts) > 1}
    for top in tops:
        _clear(Path(base, top))
    write_files(base, files)


def sandbox_path() -> str:
    """PATH inside a sandbox: this interpreter's directory first, so `python` there is the one
    running rolltap (with pytest and the SDKs), then the usual PATH."""
    return os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", os.defpath)])


def base_env(dirs: SandboxDirs, path: str) -> dict[str, str]:
    return {
        "PATH": path,
        "HOME": dirs.home,
        "LANG": "C.UTF-8",
        "TMPDIR": dirs.tmp,
        **dirs.xdg,
        "npm_config_registry": UNREACHABLE_REGISTRY,
        "npm_config_update_notifier": "false",
        "DO_NOT_TRACK": "1",
    }
