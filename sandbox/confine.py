"""Confine one sandbox phase (setup, agent, verifier) with bubblewrap.

A confined process gets its own user, PID, mount, IPC, UTS, network and cgroup namespaces
(`bwrap --unshare-all`), no capabilities, no_new_privs, its own session, and a filesystem built
from nothing: a read-only empty root with the system directories (/usr, /etc, ...) bound
read-only, the interpreter and harness installs it needs read-only, its own sandbox directories
read-write at /sandbox, a fresh /proc of its own PID namespace, a minimal /dev, and nothing else.
The task set, other sandboxes and the runner's state are not in that view at all; where a bound
directory happens to contain one of them, it is covered again (`hidden`). Its network
namespace has only a loopback interface; the gateway is reachable only through a Unix socket
bound in at GATEWAY_SOCKET (see relay.py for the forwarder).

As root, every phase also runs as an unprivileged host uid of its own (a user namespace mapped
to that uid): the agent's and the verifier's files and processes then belong to different uids
and to none of the machine's users. bwrap run by that uid cannot reach bind sources under
directories only root may enter (root's home, the sandbox parent), so a first bwrap, still
root, stages every source under a fresh tmpfs and `setpriv` drops to the uid before the
confining bwrap starts. Without root, the phases run as the caller's own uid (separate
namespaces, shared file ownership), which `warnings` reports.

When the phase's first process exits, bwrap's PID 1 exits and the kernel kills every process
left in the namespace: nothing of a phase survives into the next one.
"""

from __future__ import annotations

import functools
import os
import posixpath
import secrets
import shutil
from collections.abc import Iterable, Mapping, Sequence

import msgspec

INSIDE = "/sandbox"
GATEWAY_SOCKET = "/run/rolltap/gateway.sock"
# Where the root stage puts bind sources; a tmpfs in the stage's own mount namespace.
STAGE = "/tmp"
# Host directories the confined process sees read-only (symlinks are recreated as symlinks).
SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc")
# Sandbox uids: far above any distribution's user ranges and below the 32-bit overflow ids.
UID_BASE = 2_000_000_000
UID_SPAN = 1 << 26

MISSING_BWRAP = (
    "bubblewrap (bwrap) is not installed: sandboxes cannot be confined. Install the Debian "
    "package `bubblewrap` (apt-get install -y bubblewrap socat), or run with --isolation none "
    "to run agents unconfined (they can then read the task set and reach the machine's network)."
)


class Bind(msgspec.Struct, frozen=True, array_like=True):
    source: str  # host path
    dest: str  # path inside the sandbox
    writable: bool = False


class View(msgspec.Struct, frozen=True):
    """Everything one phase sees besides the system directories."""

    binds: tuple[Bind, ...]
    # Host paths covered again where a bind contains them, mapped to whether each is a
    # directory.
    hidden: Mapping[str, bool] = {}
    # Host path of the gateway's Unix socket; None: no way out of the network namespace.
    gateway_socket: str | None = None


class Phase(msgspec.Struct, frozen=True):
    """One confined command: who runs it, what it sees, where it starts."""

    view: View
    uid: int
    cwd: str
    argv: tuple[str, ...]


class ConfinementError(RuntimeError):
    """bwrap (or setpriv, for root) is missing."""


def new_uid() -> int:
    """An unused-by-convention host uid for one phase of one sandbox."""
    return UID_BASE + secrets.randbelow(UID_SPAN)


def is_under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


# ---- pure planning --------------------------------------------------------------------------


def system_args(kinds: Mapping[str, str | None]) -> list[str]:
    """bwrap arguments for the system directories: `kinds` maps each name of SYSTEM_DIRS that
    exists on the host to its symlink target, or None for a real directory."""
    args: list[str] = []
    for name in SYSTEM_DIRS:
        if name not in kinds:
            continue
        target = kinds[name]
        args += (["--symlink", target, f"/{name}"] if target is not None
                 else ["--ro-bind", f"/{name}", f"/{name}"])
    return args


def covers(binds: Sequence[Bind], hidden: Mapping[str, bool]) -> list[tuple[str, bool]]:
    """Where each hidden path shows up inside the sandbox (only where a bind brings it in),
    with whether it is a directory."""
    out = []
    for path, is_dir in hidden.items():
        for b in binds:
            if is_under(path, b.source):
                out.append((b.dest + path[len(b.source):], is_dir))
    return out


def exposed(binds: Sequence[Bind], hidden: Iterable[str]) -> list[tuple[str, str]]:
    """(bind source, hidden path) for every bind that lies inside a hidden path: covering
    cannot help there, the bind itself would show it."""
    return [(b.source, h) for b in binds for h in hidden if is_under(b.source, h)]


def _depth(path: str) -> int:
    return path.rstrip("/").count("/")


def inner_args(phase: Phase, *, system: list[str], staged: Mapping[str, str] | None,
               bwrap: str = "bwrap") -> list[str]:
    """The confining bwrap command line. `staged` maps host sources to where the root stage
    put them (None: no stage, sources are used where they are)."""

    def src(path: str) -> str:
        return staged[path] if staged is not None else path

    binds = phase.view.binds
    args = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
            "--new-session", "--uid", str(phase.uid), "--gid", str(phase.uid),
            "--hostname", "sandbox", *system, "--proc", "/proc", "--dev", "/dev"]
    for b in sorted(binds, key=lambda b: (_depth(b.dest), b.dest)):
        args += ["--bind" if b.writable else "--ro-bind", src(b.source), b.dest]
    hidden = covers(binds, phase.view.hidden)
    for where, is_dir in sorted(hidden, key=lambda c: (_depth(c[0]), c[0])):
        args += (["--tmpfs", where, "--remount-ro", where] if is_dir
                 else ["--ro-bind", "/dev/null", where])
    if phase.view.gateway_socket is not None:
        args += ["--ro-bind", src(phase.view.gateway_socket), GATEWAY_SOCKET]
    # The root tmpfs and the directories bwrap made in it: read-only, so nothing of the agent
    # lands outside its bounded sandbox directories.
    args += ["--remount-ro", "/", "--chdir", phase.cwd, "--", *phase.argv]
    return args


def stage_plan(phase: Phase) -> dict[str, str]:
    """Where the root stage puts each bind source (host path -> path in the stage)."""
    sources = [b.source for b in phase.view.binds]
    if phase.view.gateway_socket is not None:
        sources.append(phase.view.gateway_socket)
    return {s: f"{STAGE}/s{i}" for i, s in enumerate(dict.fromkeys(sources))}


def outer_args(phase: Phase, staged: Mapping[str, str], writable: set[str], *,
               bwrap: str = "bwrap", setpriv: str = "setpriv") -> list[str]:
    """The root stage: a mount namespace with every bind source reachable under STAGE, then
    setpriv to the phase's uid, which starts the confining bwrap."""
    args = [bwrap, "--die-with-parent", "--dev-bind", "/", "/", "--tmpfs", STAGE,
            "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    for source, where in staged.items():
        args += ["--bind" if source in writable else "--ro-bind", source, where]
    uid = str(phase.uid)
    return [*args, "--", setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]


# ---- on this machine ------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def tools() -> tuple[str, str | None]:
    """(bwrap, setpriv) paths; setpriv only matters for root. Raises ConfinementError."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise ConfinementError(MISSING_BWRAP)
    setpriv = shutil.which("setpriv")
    if setpriv is None and os.geteuid() == 0:
        raise ConfinementError("setpriv (Debian package util-linux) is not installed: "
                               "sandboxes cannot run as their own uids")
    return bwrap, setpriv


@functools.lru_cache(maxsize=1)
def host_system() -> list[str]:
    kinds: dict[str, str | None] = {}
    for name in SYSTEM_DIRS:
        path = f"/{name}"
        if os.path.islink(path):
            kinds[name] = os.readlink(path)
        elif os.path.isdir(path):
            kinds[name] = None
    return system_args(kinds)


def own_uids() -> bool:
    """Whether phases get uids of their own (only root can switch to them)."""
    return os.geteuid() == 0


def command(phase: Phase) -> list[str]:
    """The full command line that runs `phase` confined on this machine."""
    bwrap, setpriv = tools()
    if not own_uids():
        phase = msgspec.structs.replace(phase, uid=os.geteuid())
        return inner_args(phase, system=host_system(), staged=None, bwrap=bwrap)
    staged = stage_plan(phase)
    writable = {b.source for b in phase.view.binds if b.writable}
    assert setpriv is not None
    return [*outer_args(phase, staged, writable, bwrap=bwrap, setpriv=setpriv),
            *inner_args(phase, system=host_system(), staged=staged, bwrap=bwrap)]


def hidden_kinds(paths: Iterable[str]) -> dict[str, bool]:
    """Existing paths among `paths`, resolved, mapped to whether each is a directory."""
    out = {}
    for path in paths:
        real = os.path.realpath(path)
        if os.path.lexists(real):
            out[real] = os.path.isdir(real)
    return out


def ro_binds(paths: Iterable[str]) -> list[Bind]:
    """Read-only binds of existing host paths, each at its own path and, where a link leads
    there, at the path it resolves to as well (node resolves its modules by real path). A
    path already visible through another of them is left out; so are system paths."""
    wanted: dict[str, str] = {}
    for path in paths:
        if os.path.exists(path):
            real = os.path.realpath(path)
            for dest in (os.path.abspath(path), real):
                wanted.setdefault(dest, real)
    kept: list[Bind] = []
    for dest in sorted(wanted):
        source = wanted[dest]
        if _system(dest) or any(
                is_under(dest, b.dest) and source == b.source + dest[len(b.dest):]
                for b in kept):
            continue
        kept.append(Bind(source, dest))
    return kept


def _system(path: str) -> bool:
    return any(is_under(path, f"/{name}") for name in SYSTEM_DIRS)


def inside(*parts: str) -> str:
    return posixpath.join(INSIDE, *parts)
