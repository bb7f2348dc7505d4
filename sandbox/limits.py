"""Resource limits of a sandboxed process, applied in the child between fork and exec.

rlimits are per process (CPU seconds, address space, file size, open files) except
RLIMIT_NPROC, which Linux counts per user and ignores for root. So the process cap is set two
ways: RLIMIT_NPROC relative to what the user already runs (non-root), and a pids cgroup of its
own when one can be created (see cgroup.py), which also holds for root.
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


def nproc_budget(limits: Limits) -> int | None:
    """RLIMIT_NPROC for the child: its own budget on top of what the user already runs."""
    if limits.max_procs is None or os.geteuid() == 0:
        return None
    return user_task_count(os.geteuid()) + limits.max_procs


def make_preexec(table: list[tuple[int, int, int]], cgroup_procs: str | None) -> Callable[[], None]:
    """The function run in the child after fork: join the cgroup first, then lower limits.

    The cgroup is joined before exec so that not even the first fork escapes it.
    """

    def preexec() -> None:
        if cgroup_procs is not None:
            with open(cgroup_procs, "w") as fh:
                fh.write(str(os.getpid()))
        for res, soft, hard in table:
            cur_soft, cur_hard = resource.getrlimit(res)
            if cur_hard != resource.RLIM_INFINITY:
                hard = min(hard, cur_hard)
                soft = min(soft, hard)
            resource.setrlimit(res, (soft, hard))

    return preexec
