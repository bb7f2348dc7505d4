"""The verifier's own view of a Harbor trial's bwrap sandbox, held by one process for the
verifier phase (environment.py starts it when Harbor's verification starts).

Harbor runs its verifier in the trial's persistent sandbox after the agent: a service the agent
started must still answer the tests, so the agent's processes are left running. The verifier
runs as a host uid of its own that holds nothing of the agent's, in the sandbox's PID, network,
IPC, UTS and cgroup namespaces but in a mount namespace of its own whose root is a fresh tmpfs
the agent never sees:
- the system directories (SYSTEM_DIRS) as the host or the task's image has them: their links
  made from the trusted layout given by the caller, never read from the agent's root (which the
  agent may have rewritten), their directories bound read-only, only when the agent does not
  own them and without what the agent mounted inside them;
- /tests, /logs/verifier, /tmp and /root (its HOME) empty and its own: the agent can neither
  plant a hook there nor read or rewrite what the verifier writes;
- the top directory of the task's workdir copied and given to the verifier, so the tests can
  write there as in Harbor's own sandboxes (a copy that does not fit is left partial);
- every other top-level entry of the agent's root (its other files, /proc, /dev, /run) bound
  in, read-only except /dev and /proc;
- with `seal` in the spec, rolltap's seal directory (sandbox/harbor/seal.py: the pytest shims
  and launcher), root's, in place of any entry of that name the agent made.
Every source is opened without following links and mounted through its descriptor, so an agent
that swaps a directory for a link cannot point a bind elsewhere; the new root is checked to be
the verifier's own before anything is made in it.

Run by path with the host's Python as root (`python -I verifier_view.py SPEC`): it imports
only the standard library, all of it before it enters the sandbox. It prints `ready PID` (the
holder's host PID, which `nsenter --target` takes) once the view is built, then sleeps until
it is killed.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import stat
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV = 1, 2, 4
MS_NOEXEC, MS_REMOUNT, MS_NOATIME, MS_NODIRATIME = 8, 32, 1024, 2048
MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 4096, 16384, 1 << 18, 1 << 21
ST_RELATIME = 4096  # statvfs's f_flag has the MS_ values but for this one
NAMESPACES = ("ipc", "uts", "net", "cgroup", "pid", "mnt")
# The verifier's own empty directories, with their modes; Harbor's first.
FRESH = {"logs": 0o755, "tests": 0o755, "tmp": 0o1777, "root": 0o700}
# Agent entries bound writable: device nodes and the sandbox's /proc.
WRITABLE = ("dev", "proc")


def plan(entries: dict[str, tuple[str, int]], system: dict[str, str | None], copy: str | None,
         agent_uid: int) -> list[tuple[str, str, str | int | None]]:
    """The view's top level, from the agent root's entries (name -> (kind, owner uid); kind
    "dir", "link" or "file"), the trusted system layout (name -> link target, or None for a
    directory) and the workdir's top directory to copy: (action, name, argument) steps, action
    one of link (target), fresh (mode), copy, bind, bind_rw. Pure."""
    steps: list[tuple[str, str, str | int | None]] = []
    for name, target in sorted(system.items()):
        kind, owner = entries.get(name, ("", agent_uid))
        if target is not None:
            steps.append(("link", name, target))
        elif kind == "dir" and owner != agent_uid:
            steps.append(("bind", name, None))
    if copy is not None and copy not in system and copy not in ("logs", "tests") and \
            entries.get(copy, ("",))[0] == "dir":
        steps.append(("copy", copy, None))
    else:
        copy = None
    steps += [("fresh", name, mode) for name, mode in FRESH.items() if name != copy]
    taken = {name for _, name, _ in steps}
    for name, (kind, _) in sorted(entries.items()):
        if name in taken or name in system:
            continue
        if kind == "link":
            steps.append(("link", name, None))  # the agent's own link, into the view's root
        elif kind in ("dir", "file"):
            steps.append(("bind_rw" if name in WRITABLE else "bind", name, None))
    return steps


def remount_flags(current: int) -> int:
    """The flags that make a bind mount read-only and nosuid, keeping the flags it has (a
    mount's locked flags must be kept); `current` is statvfs's f_flag. Pure."""
    kept = current & (MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_NOATIME |
                      MS_NODIRATIME)
    if current & ST_RELATIME:
        kept |= MS_RELATIME
    return MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | kept


def _libc_mount():
    libc = ctypes.CDLL(None, use_errno=True)

    def mount(source: str | None, target: str, fstype: str | None, flags: int,
              data: str | None = None) -> None:
        args = [None if a is None else a.encode() for a in (source, target, fstype)]
        if libc.mount(*args, ctypes.c_ulong(flags),
                      None if data is None else data.encode()) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")

    return mount


def _entries() -> dict[str, tuple[str, int]]:
    out = {}
    for name in os.listdir("/"):
        st = os.lstat("/" + name)
        kind = ("link" if stat.S_ISLNK(st.st_mode) else "dir" if stat.S_ISDIR(st.st_mode)
                else "file" if stat.S_ISREG(st.st_mode) else "")
        out[name] = (kind, st.st_uid)
    return out


def _give(path: str, uid: int) -> None:
    for top, dirs, files in os.walk(path):
        os.lchown(top, uid, uid)
        for name in dirs + files:
            os.lchown(os.path.join(top, name), uid, uid)


def _copy(source_fd: int, name: str, uid: int) -> None:
    try:
        shutil.copytree(f"/proc/self/fd/{source_fd}", name, symlinks=True)
    except (shutil.Error, OSError) as exc:  # the agent's workdir does not fit: left partial
        print(f"rolltap: the verifier's copy of /{name} is incomplete: {exc}"[:2000],
              file=sys.stderr)
    os.makedirs(name, exist_ok=True)
    _give(name, uid)


def _open_entries(entries: dict) -> dict[str, int]:
    """An O_PATH descriptor of each top-level directory and file, never following a link."""
    opened = {}
    for name, (kind, _) in entries.items():
        if kind in ("dir", "file"):
            with_dir = os.O_DIRECTORY if kind == "dir" else 0
            try:
                opened[name] = os.open("/" + name, os.O_PATH | os.O_NOFOLLOW | with_dir)
            except OSError:
                continue
    return opened


def _fresh_root(spec: dict, mount, entries: dict, opened: dict[str, int]) -> int:
    """A fresh tmpfs over one of the directories the view replaces anyway, checked to be the
    view's own; the process's working directory from now on."""
    uid = spec["uid"]
    anchor = next((n for n in FRESH if n in opened and entries[n][0] == "dir"), None)
    if anchor is None:
        raise RuntimeError("the sandbox has none of /logs, /tests, /tmp, /root as a directory")
    mount("rolltap-verifier", f"/proc/self/fd/{opened[anchor]}", "tmpfs",
          MS_NOSUID | MS_NODEV, f"size={spec['size_mb']}m,mode=0700,uid={uid},gid={uid}")
    root = os.open("/" + anchor, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    st = os.fstat(root)
    if st.st_uid != uid or stat.S_IMODE(st.st_mode) != 0o700 or os.listdir(root):
        raise RuntimeError(f"/{anchor} changed under the verifier's root; not the view's own")
    os.fchmod(root, 0o755)
    os.fchdir(root)
    return root


def _place(step: tuple, spec: dict, mount, entries: dict, opened: dict[str, int]) -> None:
    """One step of the plan, in the view being built (the working directory)."""
    action, name, arg = step
    uid = spec["uid"]
    if action == "link":
        os.symlink(arg if arg is not None else os.readlink("/" + name), name)
    elif action == "fresh":
        os.mkdir(name)
        os.chmod(name, arg)
        os.chown(name, uid, uid)
    elif name not in opened:
        return  # gone, or not openable without following a link
    elif action == "copy":
        _copy(opened[name], name, uid)
    else:
        if entries[name][0] == "dir":
            os.mkdir(name)
        else:
            open(name, "x").close()
        flags = MS_BIND | (MS_REC if action == "bind_rw" or name not in spec["system"] else 0)
        mount(f"/proc/self/fd/{opened[name]}", name, None, flags)
        if action == "bind":
            mount(None, name, None, remount_flags(os.statvfs(name).f_flag))


def _seal(seal: dict, mount) -> None:
    """rolltap's seal directory (sandbox/harbor/seal.py) in the view being built: a tmpfs of
    root's, then read-only; a mount point, so the verifier, which owns the view's top
    directory, can neither rename nor replace it."""
    os.mkdir(seal["dir"])
    mount("rolltap-seal", seal["dir"], "tmpfs", MS_NOSUID | MS_NODEV,
          "size=4m,mode=0755,uid=0,gid=0")
    for rel, (mode, text) in sorted(seal["files"].items()):
        path = os.path.join(seal["dir"], rel)
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        with open(path, "x") as fh:
            fh.write(text)
        os.chmod(path, mode)
    mount(None, seal["dir"], None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def build(spec: dict, mount) -> None:
    """In a fresh mount namespace (the caller's is the sandbox's): the view at a fresh tmpfs,
    made the process's root."""
    uid = spec["uid"]
    # Harbor's Python (3.12) has them; pyright reads os's stub as of the project's 3.11.
    os.unshare(os.CLONE_NEWNS)  # pyright: ignore[reportAttributeAccessIssue]
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    entries = _entries()
    seal = spec.get("seal")
    if seal:  # the agent's entry of that name, if it made one, is not the view's
        entries.pop(seal["dir"], None)
    opened = _open_entries(entries)
    root = _fresh_root(spec, mount, entries, opened)
    for step in plan(entries, spec["system"], spec["copy"], spec["agent_uid"]):
        _place(step, spec, mount, entries, opened)
    if seal:
        _seal(seal, mount)
    os.makedirs("logs/verifier", exist_ok=True)
    os.chown("logs/verifier", uid, uid)
    workdir = spec["workdir"].strip("/")
    if workdir:
        try:
            os.makedirs(workdir, exist_ok=True)  # the agent removed it: the tests find it empty
        except OSError:
            pass
    for fd in (*opened.values(), root):
        os.close(fd)
    os.chroot(".")
    os.chdir("/")


def main() -> int:
    spec = json.loads(sys.argv[1])
    mount = _libc_mount()
    fds = [os.open(f"/proc/{spec['pid']}/ns/{ns}", os.O_RDONLY) for ns in NAMESPACES]
    for fd in fds:
        os.setns(fd, 0)  # pyright: ignore[reportAttributeAccessIssue] (3.12, as above)
        os.close(fd)
    ready_r, ready_w = os.pipe()
    child = os.fork()  # the PID namespace holds only the children of who entered it
    if child == 0:
        os.close(ready_r)
        try:
            build(spec, mount)
        except Exception as exc:  # noqa: BLE001 (said on stderr; the caller fails the phase)
            print(f"rolltap: the verifier's view: {type(exc).__name__}: {exc}", file=sys.stderr)
            os._exit(1)
        os.write(ready_w, b"1")
        os.close(ready_w)
        while True:
            signal.pause()
    os.close(ready_w)
    if os.read(ready_r, 1) != b"1":
        os.waitpid(child, 0)
        return 1
    print(f"ready {child}", flush=True)
    os.waitpid(child, 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
