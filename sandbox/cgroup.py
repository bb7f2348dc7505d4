"""A pids cgroup per sandboxed process tree: a process cap that holds for root too, and a way to
find and kill every process of the tree, including ones that left its session with setsid.

Created as a child of the cgroup this process lives in (cgroup v2 if its `pids` controller is
delegated there, else the v1 `pids` hierarchy). Where neither is writable, `PidsCgroup.create`
returns None and the sandbox relies on rlimits and its process group alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import uuid
from pathlib import Path


def _own_cgroup_paths() -> tuple[str | None, str | None]:
    """(v2 path, v1 pids path) of this process, from /proc/self/cgroup."""
    v2 = v1 = None
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hier, controllers, path = line.split(":", 2)
        if hier == "0" and controllers == "":
            v2 = path
        elif "pids" in controllers.split(","):
            v1 = path
    return v2, v1


def _mounts() -> tuple[tuple[str, str] | None, tuple[str, str] | None]:
    """((root, mountpoint) of cgroup2, (root, mountpoint) of the v1 pids hierarchy)."""
    v2 = v1 = None
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields, rfields = left.split(), right.split()
        if len(rfields) < 3:
            continue
        root, mountpoint, fstype, superopts = fields[3], fields[4], rfields[0], rfields[2]
        if fstype == "cgroup2" and v2 is None:
            v2 = (root, mountpoint)
        elif fstype == "cgroup" and "pids" in superopts.split(",") and v1 is None:
            v1 = (root, mountpoint)
    return v2, v1


def _join(mount: tuple[str, str], path: str) -> Path:
    root, mountpoint = mount
    rel = path[len(root) :] if root != "/" and path.startswith(root) else path
    return Path(mountpoint) / rel.lstrip("/")


def _try_parent(parent: Path) -> Path | None:
    """Create a probe child under `parent`; keep `parent` if the child gets a pids.max."""
    probe = parent / f"rolltap-probe-{uuid.uuid4().hex[:8]}"
    try:
        probe.mkdir()
    except OSError:
        return None
    try:
        usable = (probe / "pids.max").exists() and os.access(probe / "cgroup.procs", os.W_OK)
    finally:
        with contextlib.suppress(OSError):
            probe.rmdir()
    return parent if usable else None


@functools.lru_cache(maxsize=1)
def pids_parent() -> Path | None:
    """The directory sandbox cgroups are created in, or None where that is impossible."""
    try:
        own_v2, own_v1 = _own_cgroup_paths()
        mount_v2, mount_v1 = _mounts()
    except OSError:
        return None
    if own_v2 is not None and mount_v2 is not None:
        if parent := _try_parent(_join(mount_v2, own_v2)):
            return parent
    if own_v1 is not None and mount_v1 is not None:
        return _try_parent(_join(mount_v1, own_v1))
    return None


class PidsCgroup:
    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def create(cls, max_pids: int) -> PidsCgroup | None:
        parent = pids_parent()
        if parent is None:
            return None
        path = parent / f"rolltap-{uuid.uuid4().hex[:16]}"
        try:
            path.mkdir()
            (path / "pids.max").write_text(str(max_pids))
        except OSError:
            with contextlib.suppress(OSError):
                path.rmdir()
            return None
        return cls(path)

    @property
    def procs_file(self) -> str:
        return str(self.path / "cgroup.procs")

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def peak(self) -> int | None:
        with contextlib.suppress(OSError, ValueError):
            return int((self.path / "pids.peak").read_text())
        return None

    async def kill_all(self, rounds: int = 200) -> bool:
        """SIGKILL every process in the cgroup until it is empty; False if it never empties."""
        kill_file = self.path / "cgroup.kill"
        if kill_file.exists():
            with contextlib.suppress(OSError):
                kill_file.write_text("1")
        for _ in range(rounds):
            pids = self.pids()
            if not pids:
                return True
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            await asyncio.sleep(0.01)
        return not self.pids()

    async def remove(self, attempts: int = 50) -> bool:
        for _ in range(attempts):
            try:
                self.path.rmdir()
                return True
            except FileNotFoundError:
                return True
            except OSError:
                # Busy while killed processes are still being torn down.
                await asyncio.sleep(0.02)
        return False
