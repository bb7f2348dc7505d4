"""A size-bounded directory per sandbox phase: a tmpfs of its own, mounted (as root) with
util-linux `mount`, so a sandbox that fills its disk fills only that tmpfs. Its pages count
against the sandbox's memory cgroup too, so it cannot exhaust the machine's memory either.

Without root (or where the mount is refused) the directory is a plain one on the host's disk,
and `bound` returns why there is no bound, for the result's warnings.
"""

from __future__ import annotations

import os
import shutil
import subprocess

MOUNT_TIMEOUT_S = 30.0


def bound(path: str, size_mb: int | None) -> str | None:
    """Make `path` (an empty directory) a tmpfs of `size_mb`; None on success, else why not."""
    if size_mb is None:
        return "no disk limit set"
    if os.geteuid() != 0:
        return "disk not bounded: only root can give a sandbox a tmpfs of its own"
    mount = shutil.which("mount")
    if mount is None:
        return "disk not bounded: `mount` (util-linux) is not installed"
    proc = subprocess.run(
        [mount, "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0700,nosuid,nodev",
         "rolltap-sandbox", path],
        capture_output=True, text=True, timeout=MOUNT_TIMEOUT_S,
    )
    if proc.returncode != 0:
        return f"disk not bounded: mount refused ({proc.stderr.strip()})"
    return None


def release(path: str) -> None:
    """Unmount `path` if it is a mount point (lazily: a straggler's open file cannot keep
    the runner from going on)."""
    if os.path.ismount(path):
        subprocess.run(["umount", "--lazy", path], capture_output=True, timeout=MOUNT_TIMEOUT_S)
