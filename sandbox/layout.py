"""The directory tree and the environment of one sandbox.

    <root>/agent/{work,home,tmp}      the agent's area (setup and agent phases): its working
                                      directory, HOME (with the XDG directories), TMPDIR
    <root>/verifier/{work,home,tmp}   the verifier's area: a copy of the agent's final workdir
    <root>/hidden/                    the hidden tests and the protected originals, read-only
    <root>/etc/                       passwd and group naming the phase's uid

Each area is a tmpfs of its own size where the machine allows it (disk.py) and belongs to its
phase's uid. A confined phase sees its area at /sandbox/{work,home} and /tmp, and nothing else
of the tree.

The environment is built from nothing: whatever the runner holds (admin key, cloud
credentials, tokens) never reaches the harness or the verifier.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path, PurePosixPath

import msgspec

from sandbox import disk
from sandbox.confine import INSIDE
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


# Where a confined phase sees its area.
INSIDE_DIRS = SandboxDirs(root=INSIDE, work=f"{INSIDE}/work", home=f"{INSIDE}/home", tmp="/tmp")


def sandbox_parent(root: str | None) -> str:
    """The directory sandboxes are made in: `root`, or by default one in the temp dir shared
    by every sandbox of this user on the machine (every run, every Ray worker)."""
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


def make_root(parent: str, label: str) -> str:
    return tempfile.mkdtemp(prefix=f"rolltap-{label}-", dir=parent)


def make_area(root: str, name: str, size_mb: int | None) -> tuple[SandboxDirs, str | None]:
    """A fresh area under `root` (a tmpfs of `size_mb` where possible), and why its disk is
    not bounded if it is not."""
    base = os.path.join(root, name)
    os.mkdir(base, 0o700)
    problem = disk.bound(base, size_mb)
    dirs = SandboxDirs(root=base, work=f"{base}/work", home=f"{base}/home", tmp=f"{base}/tmp")
    for path in (dirs.work, dirs.tmp, *dirs.xdg.values()):
        os.makedirs(path, mode=0o700, exist_ok=True)
    return dirs, problem


def release_areas(root: str, keep: bool) -> None:
    """Unmount the areas' tmpfs; with `keep`, their contents stay, copied to the host disk."""
    for name in ("agent", "collect", "verifier"):
        area = os.path.join(root, name)
        if keep and os.path.ismount(area):
            shutil.copytree(area, area + ".kept", symlinks=True, ignore=_special)
            disk.release(area)
            os.rmdir(area)
            os.rename(area + ".kept", area)
        else:
            disk.release(area)


def _special(directory: str, names: list[str]) -> list[str]:
    """Names that are neither directories, regular files nor links (a FIFO would block a
    copy for ever)."""
    kinds = {name: os.lstat(os.path.join(directory, name)).st_mode for name in names}
    return [n for n, mode in kinds.items()
            if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode) or stat.S_ISLNK(mode))]


def remove_tree(root: str) -> None:
    # An agent may leave directories without write or search permission behind.
    def unlock(func, path, _exc):
        for p in (os.path.dirname(path), path):
            if os.path.isdir(p) and not os.path.islink(p):
                os.chmod(p, stat.S_IRWXU)
        func(path)

    if sys.version_info >= (3, 12):
        shutil.rmtree(root, onexc=unlock)
    else:
        shutil.rmtree(root, onerror=unlock)


def chown_tree(path: str, uid: int, skip: str | None = None) -> None:
    """Give `path` and everything under it to `uid` (never following a link), except its
    entry named `skip` (an image's overlay, whose files keep the image's owners)."""
    os.lchown(path, uid, uid)
    for dirpath, dirnames, filenames in os.walk(path):
        if dirpath == path and skip in dirnames:
            dirnames.remove(skip)
        for name in [*dirnames, *filenames]:
            os.lchown(os.path.join(dirpath, name), uid, uid)


class CopyOverflow(Exception):
    """The agent's workdir holds more data than the copy may take."""


def _copy_data(fin: int, fout: int, size: int) -> int:
    """Copy a file's data regions only (its holes stay holes); returns the bytes copied."""
    copied, offset = 0, 0
    while offset < size:
        try:
            start = os.lseek(fin, offset, os.SEEK_DATA)
        except OSError as exc:  # ENXIO: only a hole is left
            if exc.errno == errno.ENXIO:
                break
            raise
        end = os.lseek(fin, start, os.SEEK_HOLE)
        while start < end:
            chunk = os.pread(fin, min(end - start, 1 << 20), start)
            if not chunk:
                break
            os.pwrite(fout, chunk, start)
            start, copied = start + len(chunk), copied + len(chunk)
        offset = end
    os.ftruncate(fout, size)
    return copied


def copy_work(src: str, dst: str, skip: set[str], budget: int | None = None) -> None:
    """Copy the agent's workdir for the verifier: directories, regular files (without setuid
    bits, their holes kept as holes) and links as links; anything else, and the relative paths
    in `skip`, left out. Raises CopyOverflow once more than `budget` bytes of data would be
    copied or the destination is full: the agent made that much."""
    copied = 0
    try:
        for dirpath, dirnames, filenames in os.walk(src):
            rel_dir = os.path.relpath(dirpath, src)
            for name in [*dirnames, *filenames]:
                rel = os.path.normpath(os.path.join(rel_dir, name))
                source, target = os.path.join(dirpath, name), os.path.join(dst, rel)
                st = os.lstat(source)
                if rel in skip:
                    if name in dirnames:
                        dirnames.remove(name)
                elif stat.S_ISLNK(st.st_mode):
                    os.symlink(os.readlink(source), target)
                elif stat.S_ISDIR(st.st_mode):
                    os.mkdir(target, 0o700)
                elif stat.S_ISREG(st.st_mode):
                    if budget is not None and copied + min(st.st_blocks * 512, st.st_size) > budget:
                        raise CopyOverflow(f"more than {budget >> 20} MB of file data")
                    fin = os.open(source, os.O_RDONLY | os.O_NOFOLLOW)
                    try:
                        fout = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                        try:
                            copied += _copy_data(fin, fout, st.st_size)
                        finally:
                            os.close(fout)
                    finally:
                        os.close(fin)
                    os.chmod(target, stat.S_IMODE(st.st_mode) & 0o777)
                    if budget is not None and copied > budget:
                        raise CopyOverflow(f"more than {budget >> 20} MB of file data")
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise CopyOverflow(f"the verifier's area is full ({exc.strerror})") from None
        raise


def write_identity(root: str, uid: int) -> tuple[str, str]:
    """passwd and group files naming `uid` (whose home is the sandbox's), so that tools which
    look their user up (Node's os.userInfo) find one. Returns their paths."""
    etc = os.path.join(root, "etc", str(uid))
    os.makedirs(etc, exist_ok=True)
    passwd, group = os.path.join(etc, "passwd"), os.path.join(etc, "group")
    with open(passwd, "w") as fh:
        fh.write(f"root:x:0:0:root:/root:/bin/sh\nsandbox:x:{uid}:{uid}:rolltap sandbox:"
                 f"{INSIDE_DIRS.home}:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n")
    with open(group, "w") as fh:
        fh.write(f"root:x:0:\nsandbox:x:{uid}:\nnogroup:x:65534:\n")
    return passwd, group


@functools.lru_cache(maxsize=1)
def runtime_paths() -> tuple[str, ...]:
    """What a confined phase needs to run rolltap's python (the `python` preset, pytest
    verifiers): the interpreter's prefixes, its import path, and this `sandbox` package."""
    code = "import json, sys; print(json.dumps([sys.prefix, sys.base_prefix, *sys.path]))"
    proc = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True,
                          check=True, timeout=60)
    paths = [p for p in json.loads(proc.stdout) if p and os.path.isabs(p)]
    return (*paths, os.path.dirname(os.path.abspath(__file__)))


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
