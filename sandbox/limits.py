"""Resource limits of a sandboxed process, applied in the child between fork and exec.

rlimits are per process (CPU seconds, address space, file size, open files) except
RLIMIT_NPROC, which Linux counts per user and ignores for root. So the process cap is set two
ways: RLIMIT_NPROC (a confined sandbox runs as a uid of its own, so the count is its own), and a
pids cgroup of its own when one can be created (see cgroup.py), which also holds for root.
Memory and CPU of the whole sandbox are cgroup limits; its disk is the size of its own tmpfs
(disk.py). A confined sandbox cannot raise any of them: it has no capabilities.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Callable

import msgspec

MB = 1 << 20


class Limits(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    cpu_s: int | None = 600
    address_space_mb: int | None = 4096
    max_procs: int | None = 256  # tasks, threads included (both the cgroup and NPROC count them)
    file_size_mb: int | None = 512
    open_files: int | None = 4096
    # The whole sandbox (every process of a phase): cgroup memory (no swap), CPUs of CPU time
    # per wall-clock second, and the size of its writable directories.
    memory_mb: int | None = 4096
    cpus: float | None = 1.0
    disk_mb: int | None = 1024
    # Bytes of stdout and of stderr kept (head + tail) per process; the rest is counted only.
    output_bytes: int = 256 * 1024


def rlimit_table(limits: Limits, nproc: int | None) -> list[tuple[int, int, int]]:
    """The (resource, soft, hard) triples to set for `limits`."""
    table = []
    if limits.cpu_s is not None:
        # SIGXCPU at the soft limit lets a process die cleanly; SIGKILL a little later.
        table.append((resource.RLIMIT_CPU, limits.cpu_s, limits.cpu_s + 5))
    if limits.address_space_mb is not None:
        size = limits.address_space_mb * MB
        table.append((resource.RLIMIT_AS, size, size))
    if limits.file_size_mb is not None:
        size = limits.file_size_mb * MB
        table.append((resource.RLIMIT_FSIZE, size, size))
    if limits.open_files is not None:
        table.append((resource.RLIMIT_NOFILE, limits.open_files, limits.open_files))
    if nproc is not None:
        table.append((resource.RLIMIT_NPROC, nproc, nproc))
    table.append((resource.RLIMIT_CORE, 0, 0))
    return table


def user_task_count(uid: int) -> int:
    """Tasks (threads included, as RLIMIT_NPROC counts them) the user runs now."""
    count = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status", "rb") as fh:
                status = fh.read()
        except OSError:
            continue
        fields = dict(
            line.split(b":", 1) for line in status.splitlines() if b":" in line
        )
        if int(fields.get(b"Uid", b"-1").split()[0]) == uid:
            count += int(fields.get(b"Threads", b"1").strip())
    return count


def nproc_budget(limits: Limits, own_uid: bool) -> int | None:
    """RLIMIT_NPROC for the child: all of it for a uid of its own, else its own budget on top
    of what the user already runs (none for root, which the kernel does not count)."""
    if limits.max_procs is None:
        return None
    if own_uid:
        return limits.max_procs
    if os.geteuid() == 0:
        return None
    return user_task_count(os.geteuid()) + limits.max_procs


def cgroup_limits(limits: Limits) -> dict[str, float | None]:
    """controller -> limit, for Cgroup.create."""
    return {"pids": limits.max_procs, "memory": limits.memory_mb, "cpu": limits.cpus}


def make_preexec(table: list[tuple[int, int, int]], cgroup_procs: list[str]) -> Callable[[], None]:
    """The function run in the child after fork: join the cgroups first, then lower limits.

    The cgroups are joined before exec so that not even the first fork escapes them.
    """

    def preexec() -> None:
        for procs in cgroup_procs:
            with open(procs, "w") as fh:
                fh.write(str(os.getpid()))
        for res, soft, hard in table:
            cur_soft, cur_hard = resource.getrlimit(res)
            if cur_hard != resource.RLIM_INFINITY:
                hard = min(hard, cur_hard)
                soft = min(soft, hard)
            resource.setrlimit(res, (soft, hard))

    return preexec
