"""A cgroup per sandboxed process tree: process, memory and CPU caps that hold for root inside a
sandbox too, and a way to find and kill every process of the tree whatever it did.

Each controller (pids, memory, cpu) is taken from cgroup v2 where it is available below this
process's own cgroup, else from its v1 hierarchy; a controller available in neither is left
out, and `Cgroup.controllers` says which hold. The tree joins the cgroup before its first exec
(limits.make_preexec), so not even its first fork escapes. A confined sandbox cannot leave it:
it has no capabilities and no /sys/fs/cgroup at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import uuid
from collections.abc import Mapping
from pathlib import Path

# controller -> (file that shows it is there in v2, in v1)
CONTROLLERS = {
    "pids": ("pids.max", "pids.max"),
    "memory": ("memory.max", "memory.limit_in_bytes"),
    "cpu": ("cpu.max", "cpu.cfs_quota_us"),
}
CPU_PERIOD_US = 100_000


def _own_cgroup_paths() -> tuple[str | None, dict[str, str]]:
    """(v2 path, {v1 controller: path}) of this process, from /proc/self/cgroup."""
    v2, v1 = None, {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hier, controllers, path = line.split(":", 2)
        if hier == "0" and controllers == "":
            v2 = path
        for c in controllers.split(","):
            v1[c] = path
    return v2, v1


def _mounts() -> tuple[tuple[str, str] | None, dict[str, tuple[str, str]]]:
    """((root, mountpoint) of cgroup2, {v1 controller: (root, mountpoint)})."""
    v2, v1 = None, {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields, rfields = left.split(), right.split()
        if len(rfields) < 3:
            continue
        root, mountpoint, fstype, superopts = fields[3], fields[4], rfields[0], rfields[2]
        if fstype == "cgroup2" and v2 is None:
            v2 = (root, mountpoint)
        elif fstype == "cgroup":
            for c in superopts.split(","):
                v1.setdefault(c, (root, mountpoint))
    return v2, v1


def _join(mount: tuple[str, str], path: str) -> Path:
    root, mountpoint = mount
    rel = path[len(root) :] if root != "/" and path.startswith(root) else path
    return Path(mountpoint) / rel.lstrip("/")


def _usable(parent: Path, marker: str) -> bool:
    """Whether a child made under `parent` gets `marker` and can be joined."""
    probe = parent / f"rolltap-probe-{uuid.uuid4().hex[:8]}"
    try:
        probe.mkdir()
    except OSError:
        return False
    try:
        return (probe / marker).exists() and os.access(probe / "cgroup.procs", os.W_OK)
    finally:
        with contextlib.suppress(OSError):
            probe.rmdir()


@functools.lru_cache(maxsize=1)
def parents() -> dict[str, Path]:
    """controller -> the directory sandbox cgroups are made in, for the controllers this
    machine lets this process use."""
    try:
        own_v2, own_v1 = _own_cgroup_paths()
        mount_v2, mount_v1 = _mounts()
    except OSError:
        return {}
    found: dict[str, Path] = {}
    for controller, (v2_marker, v1_marker) in CONTROLLERS.items():
        if own_v2 is not None and mount_v2 is not None:
            parent = _join(mount_v2, own_v2)
            if _usable(parent, v2_marker):
                found[controller] = parent
                continue
        if controller in own_v1 and controller in mount_v1:
            parent = _join(mount_v1[controller], own_v1[controller])
            if _usable(parent, v1_marker):
                found[controller] = parent
    return found


def limit_files(controller: str, v2: bool, value: float) -> dict[str, str]:
    """The files to write for one controller's limit. Pure. `value`: pids count, memory MiB,
    or CPUs."""
    if controller == "pids":
        return {"pids.max": str(int(value))}
    if controller == "memory":
        size = str(int(value) << 20)
        # No swap either: otherwise the limit only moves the sandbox's memory to disk.
        return ({"memory.max": size, "memory.swap.max": "0"} if v2
                else {"memory.limit_in_bytes": size, "memory.memsw.limit_in_bytes": size})
    quota = max(1000, int(value * CPU_PERIOD_US))
    return ({"cpu.max": f"{quota} {CPU_PERIOD_US}"} if v2
            else {"cpu.cfs_period_us": str(CPU_PERIOD_US), "cpu.cfs_quota_us": str(quota)})


class Cgroup:
    def __init__(self, dirs: dict[str, Path]) -> None:
        self.dirs = dirs  # controller -> its directory (v2 controllers share one)

    @property
    def controllers(self) -> tuple[str, ...]:
        return tuple(sorted(self.dirs))

    @classmethod
    def create(cls, limits: Mapping[str, float | None]) -> Cgroup | None:
        """A new cgroup with `limits` (controller -> value, None: no limit but still joined)
        for every controller available here; None where there is none."""
        made: dict[Path, Path] = {}
        dirs: dict[str, Path] = {}
        name = f"rolltap-{uuid.uuid4().hex[:16]}"
        try:
            for controller, parent in parents().items():
                if controller not in limits:
                    continue
                if parent not in made:
                    (parent / name).mkdir()
                    made[parent] = parent / name
                path = made[parent]
                value = limits[controller]
                if value is not None:
                    v2 = (path / CONTROLLERS[controller][0]).exists()
                    for fname, text in limit_files(controller, v2, value).items():
                        if (path / fname).exists():
                            (path / fname).write_text(text)
                dirs[controller] = path
        except OSError:
            for path in made.values():
                with contextlib.suppress(OSError):
                    path.rmdir()
            return None
        return cls(dirs) if dirs else None

    @property
    def procs_files(self) -> list[str]:
        return [str(p / "cgroup.procs") for p in dict.fromkeys(self.dirs.values())]

    def pids(self) -> list[int]:
        found: set[int] = set()
        for procs in self.procs_files:
            with contextlib.suppress(OSError):
                found.update(int(p) for p in Path(procs).read_text().split())
        return sorted(found)

    def _read_int(self, controller: str, *names: str) -> int | None:
        path = self.dirs.get(controller)
        if path is None:
            return None
        for name in names:
            with contextlib.suppress(OSError, ValueError):
                return int((path / name).read_text())
        return None

    def peak_pids(self) -> int | None:
        return self._read_int("pids", "pids.peak")

    def peak_memory_mb(self) -> int | None:
        peak = self._read_int("memory", "memory.peak", "memory.max_usage_in_bytes")
        return None if peak is None else peak >> 20

    async def kill_all(self, rounds: int = 200) -> bool:
        """SIGKILL every process in the cgroup until it is empty; False if it never empties."""
        for path in dict.fromkeys(self.dirs.values()):
            if (path / "cgroup.kill").exists():
                with contextlib.suppress(OSError):
                    (path / "cgroup.kill").write_text("1")
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
        left = list(dict.fromkeys(self.dirs.values()))
        for _ in range(attempts):
            for path in list(left):
                try:
                    path.rmdir()
                    left.remove(path)
                except FileNotFoundError:
                    left.remove(path)
                except OSError:
                    pass  # busy while killed processes are still being torn down
            if not left:
                return True
            await asyncio.sleep(0.02)
        return False
