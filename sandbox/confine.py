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

With a task image (`View.image`), `/` is that image's unpacked root filesystem (images.py)
instead of the host's system directories, under an overlay whose writable layer lies in the
phase's own bounded area: the sandbox starts without a copy, and what it writes reaches neither
the image cache nor another sandbox. bubblewrap 0.8 mounts no overlays, so the root stage does
(the kernel's overlayfs), creates the mount points of the binds in it, and the confining bwrap
takes it as `/`. The host's system directories are then at HOST_ROOT, read-only, for the
programs rolltap brings in (hostexec.py runs them with the host's own loader and libraries,
whatever the image's libc). Images need root: only the root stage can mount the overlay.

When the phase's first process exits, bwrap's PID 1 exits and the kernel kills every process
left in the namespace: nothing of a phase survives into the next one.
"""

from __future__ import annotations

import functools
import os
import posixpath
import secrets
import shlex
import shutil
from collections.abc import Callable, Iterable, Mapping, Sequence

import msgspec

INSIDE = "/sandbox"
# rolltap's own directory inside a sandbox: the gateway's socket, and with an image the host's
# system directories (HOST_ROOT). A tmpfs of the sandbox's own, read-only once set up.
RUN_DIR = "/run/rolltap"
GATEWAY_SOCKET = f"{RUN_DIR}/gateway.sock"
HOST_ROOT = f"{RUN_DIR}/host"
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


class Image(msgspec.Struct, frozen=True):
    """A root filesystem for `/`: `rootfs` (read-only, shared by every sandbox of the image)
    under an overlay whose upper and work directories go in `overlay` (the phase's area: its
    size bound is the overlay's)."""

    rootfs: str
    overlay: str


class View(msgspec.Struct, frozen=True):
    """Everything one phase sees besides the system directories."""

    binds: tuple[Bind, ...]
    # Host paths covered again where a bind contains them, mapped to whether each is a
    # directory.
    hidden: Mapping[str, bool] = {}
    # Host path of the gateway's Unix socket; None: no way out of the network namespace.
    gateway_socket: str | None = None
    # The task's image as `/`; None: the host's system directories.
    image: Image | None = None


class Phase(msgspec.Struct, frozen=True):
    """One confined command: who runs it, what it sees, where it starts."""

    view: View
    uid: int
    cwd: str
    argv: tuple[str, ...]


NO_IMAGE_WITHOUT_ROOT = (
    "task images need the runner to run as root: the image's overlay is mounted by the root "
    "stage (bubblewrap 0.8 mounts no overlays). Run as root, or drop `image` from the task.")
# Where the root stage mounts an image's overlay (in its own tmpfs at STAGE).
STAGED_ROOT = f"{STAGE}/root"


class ConfinementError(RuntimeError):
    """bwrap (or setpriv, for root) is missing."""


def new_uid() -> int:
    """An unused-by-convention host uid for one phase of one sandbox."""
    return UID_BASE + secrets.randbelow(UID_SPAN)


def is_under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


# ---- pure planning --------------------------------------------------------------------------


def system_args(kinds: Mapping[str, str | None], at: str = "") -> list[str]:
    """bwrap arguments for the system directories: `kinds` maps each name of SYSTEM_DIRS that
    exists on the host to its symlink target, or None for a real directory. `at`: where they
    go (an image's sandbox has them under HOST_ROOT)."""
    args: list[str] = []
    for name in SYSTEM_DIRS:
        if name not in kinds:
            continue
        target = kinds[name]
        args += (["--symlink", target, f"{at}/{name}"] if target is not None
                 else ["--ro-bind", f"/{name}", f"{at}/{name}"])
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
            "--hostname", "sandbox"]
    image = phase.view.image is not None
    if image:
        # The stage's overlay as `/`, rolltap's directory a tmpfs of the sandbox's own.
        args += ["--bind", STAGED_ROOT, "/", "--tmpfs", RUN_DIR]
    args += [*system, "--proc", "/proc", "--dev", "/dev"]
    for b in sorted(binds, key=lambda b: (_depth(b.dest), b.dest)):
        args += ["--bind" if b.writable else "--ro-bind", src(b.source), b.dest]
    hidden = covers(binds, phase.view.hidden)
    for where, is_dir in sorted(hidden, key=lambda c: (_depth(c[0]), c[0])):
        args += (["--tmpfs", where, "--remount-ro", where] if is_dir
                 else ["--ro-bind", "/dev/null", where])
    if phase.view.gateway_socket is not None:
        args += ["--ro-bind", src(phase.view.gateway_socket), GATEWAY_SOCKET]
    # The root tmpfs and the directories bwrap made in it: read-only, so nothing of the agent
    # lands outside its bounded sandbox directories. An image's root is its bounded overlay.
    args += ["--remount-ro", RUN_DIR if image else "/", "--chdir", phase.cwd, "--",
             *phase.argv]
    return args


def mount_points(phase: Phase, is_dir: Callable[[str], bool]) -> list[tuple[str, bool]]:
    """What the root stage makes in an image's overlay before the confining bwrap, which runs
    as the sandbox's uid and may not write the image's root-owned directories: every bind's
    destination (a directory or a file, as its source) and rolltap's own directory."""
    wanted = {RUN_DIR: True, "/proc": True, "/dev": True, "/tmp": True}
    for b in phase.view.binds:
        wanted.setdefault(b.dest, is_dir(b.source))
    return sorted(wanted.items())


def _ancestors(path: str) -> list[str]:
    """The directories above `path`, from the top (not `/`)."""
    parts = path.strip("/").split("/")[:-1]
    return ["/" + "/".join(parts[:i]) for i in range(1, len(parts) + 1)]


# A shell function of the root stage: fail on any argument that is a symbolic link.
REFUSE_LINKS = f"""no_links() {{
  for p in "$@"; do
    if [ -L "$p" ]; then
      echo "rolltap: the image has a symbolic link at ${{p#{STAGED_ROOT}}}, where the sandbox \
mounts rolltap's files; remove it from the image" >&2
      exit 125
    fi
  done
}}"""


def stage_script(image: Image, staged: Mapping[str, str],
                 points: Sequence[tuple[str, bool]], *, size_mb: int | None = None,
                 owner: int | None = None, owned: Sequence[str] = ()) -> str:
    """The root stage's shell step for an image: the overlay at STAGED_ROOT, its root owned and
    moded as the image's (the upper directory's attributes are the merged root's), the mount
    points made, and every directory above one searchable (not listable) by the sandbox.

    For a sandbox whose root is the image's root user (Harbor's): `size_mb` puts the overlay's
    writable layer on a tmpfs of that size in the stage's own mount namespace (it has no
    bounded area of its own), and `owner` gets the root directory and the `owned` directories
    (made, then given recursively: copied up, the image's other files stay the image's)."""
    lower, overlay = staged[image.rootfs], staged[image.overlay]
    q = shlex.quote
    bound = ([f"mount -t tmpfs -o size={size_mb}m,mode=0700,nosuid,nodev rolltap-overlay "
              f"{overlay}"] if size_mb is not None else [])
    lines = ["set -e", REFUSE_LINKS, *bound,
             f"mkdir -p {STAGED_ROOT} {overlay}/upper {overlay}/work",
             f"chown --reference={lower} {overlay}/upper",
             f"chmod --reference={lower} {overlay}/upper",
             f"mount -t overlay rolltap-image -o nodev,nosuid,lowerdir={lower},"
             f"upperdir={overlay}/upper,"
             f"workdir={overlay}/work {STAGED_ROOT}"]
    for path, is_dir in points:
        where = q(STAGED_ROOT + path)
        ancestors = _ancestors(path)
        # The stage sees the host's files: a link in the image there would lead root out of it.
        lines.append("no_links " + " ".join(q(STAGED_ROOT + p) for p in [*ancestors, path]))
        lines.append(f"mkdir -p {where}" if is_dir else
                     f"mkdir -p {q(STAGED_ROOT + posixpath.dirname(path))}; "
                     f"[ -e {where} ] || : > {where}")
        lines += [f"chmod o+x {q(STAGED_ROOT + p)}" for p in ancestors]
    if owner is not None:
        lines.append(f"chown {owner}:{owner} {STAGED_ROOT}")
        for path in (p for p in owned if p.strip("/")):
            where = q(STAGED_ROOT + path)
            lines += ["no_links " + " ".join(q(STAGED_ROOT + p)
                                             for p in [*_ancestors(path), path]),
                      f"mkdir -p {where}", f"chown -R -P {owner}:{owner} {where}"]
    return "\n".join([*lines, 'exec "$@"'])


def stage_plan(phase: Phase) -> dict[str, str]:
    """Where the root stage puts each bind source (host path -> path in the stage)."""
    sources = [b.source for b in phase.view.binds]
    if phase.view.gateway_socket is not None:
        sources.append(phase.view.gateway_socket)
    if phase.view.image is not None:
        sources += [phase.view.image.rootfs, phase.view.image.overlay]
    return {s: f"{STAGE}/s{i}" for i, s in enumerate(dict.fromkeys(sources))}


def outer_args(phase: Phase, staged: Mapping[str, str], writable: set[str], *,
               bwrap: str = "bwrap", setpriv: str = "setpriv",
               image_step: Sequence[str] = ()) -> list[str]:
    """The root stage: a mount namespace with every bind source reachable under STAGE, then
    (with an image) `image_step`, the overlay made, then setpriv to the phase's uid, which
    starts the confining bwrap."""
    caps = ["CAP_SETUID", "CAP_SETGID"]
    if image_step:
        caps += ["CAP_SYS_ADMIN", "CAP_CHOWN", "CAP_FOWNER", "CAP_DAC_OVERRIDE"]
    args = [bwrap, "--die-with-parent", "--dev-bind", "/", "/", "--tmpfs", STAGE]
    for cap in caps:
        args += ["--cap-add", cap]
    for source, where in staged.items():
        args += ["--bind" if source in writable else "--ro-bind", source, where]
    uid = str(phase.uid)
    return [*args, "--", *image_step, setpriv, f"--reuid={uid}", f"--regid={uid}",
            "--clear-groups", "--"]


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


@functools.lru_cache(maxsize=2)
def host_system(at: str = "") -> list[str]:
    kinds: dict[str, str | None] = {}
    for name in SYSTEM_DIRS:
        path = f"/{name}"
        if os.path.islink(path):
            kinds[name] = os.readlink(path)
        elif os.path.isdir(path):
            kinds[name] = None
    return system_args(kinds, at)


def own_uids() -> bool:
    """Whether phases get uids of their own (only root can switch to them)."""
    return os.geteuid() == 0


def command(phase: Phase) -> list[str]:
    """The full command line that runs `phase` confined on this machine."""
    bwrap, setpriv = tools()
    image = phase.view.image
    if not own_uids():
        if image is not None:
            raise ConfinementError(NO_IMAGE_WITHOUT_ROOT)
        phase = msgspec.structs.replace(phase, uid=os.geteuid())
        return inner_args(phase, system=host_system(), staged=None, bwrap=bwrap)
    staged = stage_plan(phase)
    writable = {b.source for b in phase.view.binds if b.writable}
    step: list[str] = []
    if image is not None:
        writable.add(image.overlay)
        script = stage_script(image, staged, mount_points(phase, os.path.isdir))
        step = ["/bin/sh", "-c", script, "rolltap-image"]
    assert setpriv is not None
    system = host_system(HOST_ROOT if image is not None else "")
    return [*outer_args(phase, staged, writable, bwrap=bwrap, setpriv=setpriv,
                        image_step=step),
            *inner_args(phase, system=system, staged=staged, bwrap=bwrap)]


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
