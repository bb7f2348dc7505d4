"""Hide parts of the machine's filesystem from a sandboxed process.

The process gets a private mount namespace, entered in the child between fork and exec: an
empty read-only tmpfs over every hidden directory, /dev/null over every hidden file, and the
sandbox's own directory bound back where it lies inside a hidden one. Then it loses the
capabilities with which a root process could undo or go around that (unmount, mount anew,
enter another namespace, open files by handle, reach other processes' memory and root
directories, read raw disks). Everything else (uid, network, the rest of the filesystem)
stays as it is.

Needs root (CAP_SYS_ADMIN) where it runs; `unavailable_reason` says once per process whether
it works, so a backend can fall back to running without it and say so.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import posixpath
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping
from typing import Literal

import msgspec

log = logging.getLogger(__name__)

# "mounts": the agent ran in its own mount namespace. "disabled": turned off by the user.
# "unavailable": this machine refused the namespace; the agent ran without it.
IsolationStatus = Literal["mounts", "disabled", "unavailable"]

# empty: a read-only empty tmpfs over a directory. null: /dev/null over a file (a tmpfs cannot
# cover a file). keep: the original directory bound back inside a hidden one.
Action = Literal["empty", "null", "keep"]

CLONE_NEWNS = 0x00020000
MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
PR_CAPBSET_DROP = 24
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
LINUX_CAPABILITY_VERSION_3 = 0x20080522

# What would let a root process undo or get around the mounts: SYS_ADMIN (umount, mount,
# setns), DAC_READ_SEARCH (open_by_handle_at reaches any file of a filesystem), SYS_PTRACE and
# CHECKPOINT_RESTORE (other processes' memory, /proc/PID/root of processes that keep their
# capabilities), SYS_MODULE, SYS_RAWIO, BPF, PERFMON (kernel and memory access), MKNOD (a new
# node for the disk).
DROPPED_CAPABILITIES = {
    "CAP_DAC_READ_SEARCH": 2,
    "CAP_SYS_MODULE": 16,
    "CAP_SYS_RAWIO": 17,
    "CAP_SYS_PTRACE": 19,
    "CAP_SYS_ADMIN": 21,
    "CAP_MKNOD": 27,
    "CAP_PERFMON": 38,
    "CAP_BPF": 39,
    "CAP_CHECKPOINT_RESTORE": 40,
}

EMPTY_TMPFS_OPTIONS = b"mode=0755,size=64k"
PROBE_TIMEOUT_S = 60.0


class MountOp(msgspec.Struct, frozen=True, array_like=True):
    path: str
    action: Action


# ---- pure planning --------------------------------------------------------------------------


def _depth(path: str) -> int:
    return 0 if path == "/" else path.count("/")


def _nearest(path: str, chosen: Mapping[str, Action]) -> Action | None:
    """The action of the deepest chosen strict ancestor of `path`."""
    while path != "/":
        path = posixpath.dirname(path)
        if path in chosen:
            return chosen[path]
    return None


def plan_mounts(actions: Mapping[str, Action]) -> tuple[MountOp, ...]:
    """The mounts, in order, that make every path under a hidden one invisible unless a kept
    directory nearer to it brings it back.

    Parents come before children. A hide under another hide is left out (already covered), a
    keep not under a hide too (already visible), so every kept directory is created inside the
    tmpfs of its nearest hidden ancestor.
    """
    for path, action in actions.items():
        if not posixpath.isabs(path) or posixpath.normpath(path) != path:
            raise ValueError(f"not an absolute, normalised path: {path!r}")
        if path == "/" and action != "keep":
            raise ValueError("the root directory cannot be hidden")
    chosen: dict[str, Action] = {}
    for path in sorted(actions, key=lambda p: (_depth(p), p)):
        action = actions[path]
        hidden_above = _nearest(path, chosen) == "empty"
        if (action == "keep") == hidden_above:
            chosen[path] = action
    return tuple(MountOp(path, action) for path, action in chosen.items())


# ---- planning on this machine ---------------------------------------------------------------


def hide_action(path: str) -> tuple[str, Action] | None:
    """(resolved path, how to hide it), or None for a path that does not exist."""
    real = os.path.realpath(path)
    try:
        st = os.stat(real)
    except OSError:
        return None
    return real, ("empty" if stat.S_ISDIR(st.st_mode) else "null")


def block_devices(dev: str = "/dev") -> list[str]:
    """Block device nodes in `dev`: root reads a disk's raw blocks, and the files on it, past
    any mount."""
    found = []
    with os.scandir(dev) as entries:
        for entry in entries:
            try:
                if stat.S_ISBLK(entry.stat(follow_symlinks=False).st_mode):
                    found.append(entry.path)
            except OSError:
                continue
    return sorted(found)


def sandbox_mounts(hide: Iterable[str], keep: str) -> tuple[MountOp, ...]:
    """The mounts that hide `hide` (files or directories; missing ones are skipped) and every
    block device, and keep the directory `keep` visible even where it lies inside them."""
    actions: dict[str, Action] = {}
    for path in [*hide, *block_devices()]:
        if (found := hide_action(path)) is not None:
            actions[found[0]] = found[1]
    actions[os.path.realpath(keep)] = "keep"
    return plan_mounts(actions)


# ---- in the child, between fork and exec ----------------------------------------------------


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    # Loaded in the parent (see unavailable_reason), so the child between fork and exec only
    # calls into it.
    return ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), what)


def unshare(flags: int) -> None:
    _check(_libc().unshare(flags), "unshare")


def mount(source: str | None, target: str, fstype: str | None, flags: int,
          data: bytes | None = None) -> None:
    enc = os.fsencode
    _check(
        _libc().mount(
            enc(source) if source is not None else None,
            enc(target),
            enc(fstype) if fstype is not None else None,
            ctypes.c_ulong(flags),
            data,
        ),
        f"mount {target}",
    )


def drop_capabilities() -> None:
    """Drop DROPPED_CAPABILITIES from the bounding set (so no later exec of a root program gets
    them back) and from the effective, permitted and inheritable sets."""
    libc = _libc()
    with open("/proc/sys/kernel/cap_last_cap") as fh:
        last = int(fh.read())
    caps = [cap for cap in DROPPED_CAPABILITIES.values() if cap <= last]
    for cap in caps:
        _check(libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"drop capability {cap}")
    _check(libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clear ambient")
    header = _CapHeader(LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    _check(libc.capget(ctypes.byref(header), data), "capget")
    for cap in caps:
        word, bit = divmod(cap, 32)
        mask = ~(1 << bit) & 0xFFFFFFFF
        data[word].effective &= mask
        data[word].permitted &= mask
        data[word].inheritable &= mask
    _check(libc.capset(ctypes.byref(header), data), "capset")


def enter(ops: Iterable[MountOp], cwd: str) -> None:
    """Enter a private mount namespace with `ops` applied, then drop the capabilities that
    could undo it. Runs in the child; raises OSError on any failure (the command must then
    not run)."""
    unshare(CLONE_NEWNS)
    # Private, so nothing mounted here propagates back to the machine's namespace.
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    ops = list(ops)
    # Opened before anything is hidden: a kept directory may lie under a hidden one.
    sources = {op.path: os.open(op.path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
               for op in ops if op.action == "keep"}
    null = os.open("/dev/null", os.O_PATH | os.O_CLOEXEC)
    flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
    try:
        for op in ops:
            if op.action == "empty":
                mount("tmpfs", op.path, "tmpfs", flags, EMPTY_TMPFS_OPTIONS)
            elif op.action == "null":
                mount(f"/proc/self/fd/{null}", op.path, None, MS_BIND)
            else:
                os.makedirs(op.path, exist_ok=True)  # inside the tmpfs that hides it
                mount(f"/proc/self/fd/{sources[op.path]}", op.path, None, MS_BIND | MS_REC)
        # Read-only only now: the kept directories' mount points had to be made first.
        for op in ops:
            if op.action == "empty":
                mount(None, op.path, None, MS_REMOUNT | MS_RDONLY | flags)
    finally:
        for fd in [*sources.values(), null]:
            os.close(fd)
    # The working directory was entered before the mounts; enter it again through them.
    os.chdir(cwd)
    drop_capabilities()


# ---- does it work here? ---------------------------------------------------------------------


def _probe_child(ops: tuple[MountOp, ...]) -> None:
    try:
        enter(ops, "/")
    except OSError as exc:
        os.write(2, str(exc).encode())
        os._exit(1)


@functools.lru_cache(maxsize=1)
def unavailable_reason() -> str | None:
    """None if sandboxed processes can get a private mount namespace here, else why not.

    Tried once per process, in a throwaway child doing exactly what a sandbox's child does.
    """
    _libc()
    with tempfile.TemporaryDirectory(prefix="rolltap-isolation-probe-") as target:
        ops = plan_mounts({os.path.realpath(target): "empty"})
        try:
            proc = subprocess.run(
                [sys.executable, "-I", "-S", "-c", ""],
                preexec_fn=functools.partial(_probe_child, ops),
                capture_output=True,
                timeout=PROBE_TIMEOUT_S,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            reason = f"probe failed: {exc}"
        else:
            reason = None
            if proc.returncode != 0:
                reason = proc.stderr.decode(errors="replace").strip() or (
                    f"probe exited {proc.returncode}"
                )
    if reason is not None:
        log.warning("sandbox mount isolation unavailable (%s): agents will run without it "
                    "and could read hidden tests on this machine", reason)
    return reason
