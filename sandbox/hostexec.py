"""Run the host's programs inside a task image, whatever libc the image has (or none).

In an image's sandbox the host's system directories are at confine.HOST_ROOT and rolltap's
own installs (its interpreter, an npm harness) at their host paths. A host program started
there the usual way would get the image's dynamic loader and libraries. Started through the
host's own loader, with the host's library directories and without the image's loader cache,
it runs as on the host:

    /run/rolltap/host/lib64/ld-linux-x86-64.so.2 --inhibit-cache --library-path HOST_LIBS PROG

What it starts in turn (the agent's shell commands, the tests) is the image's again. A program
the host can run this way: an ELF executable, or a script whose interpreter is one (`#!`, also
through `/usr/bin/env`). Anything else cannot be brought in: HostProgramError names the fix.
"""

from __future__ import annotations

import functools
import os
import posixpath
import shlex
import shutil
import struct
from collections.abc import Callable, Sequence

from sandbox.confine import HOST_ROOT, SYSTEM_DIRS, is_under

PT_INTERP = 3
ELF_MAGIC = b"\x7fELF"
SHEBANG_MAX = 256


class HostProgramError(RuntimeError):
    """A program rolltap must bring into an image that cannot run there."""


def elf_interpreter(head: bytes) -> str | None:
    """The dynamic loader a 64-bit little-endian ELF file names (PT_INTERP), from its first
    bytes; None for a static executable or anything else."""
    if len(head) < 64 or head[:4] != ELF_MAGIC or head[4] != 2 or head[5] != 1:
        return None
    phoff, = struct.unpack_from("<Q", head, 32)
    phentsize, phnum = struct.unpack_from("<HH", head, 54)
    for i in range(phnum):
        at = phoff + i * phentsize
        if at + 56 > len(head):
            return None
        kind, = struct.unpack_from("<I", head, at)
        if kind == PT_INTERP:
            offset, = struct.unpack_from("<Q", head, at + 8)
            size, = struct.unpack_from("<Q", head, at + 32)
            return head[offset:offset + size].rstrip(b"\0").decode()
    return None


def shebang(head: bytes) -> list[str] | None:
    """A script's interpreter and its argument (`#!/usr/bin/env node` -> [env, node])."""
    if not head.startswith(b"#!"):
        return None
    line = head[2:SHEBANG_MAX].split(b"\n", 1)[0].decode(errors="replace").strip()
    return line.split(None, 1) or None


def inside(path: str) -> str:
    """Where a host path is inside an image's sandbox."""
    system = any(is_under(path, f"/{name}") for name in SYSTEM_DIRS)
    return HOST_ROOT + path if system else path


def _head(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read(4096)


@functools.lru_cache(maxsize=8)
def library_path(loader: str) -> str:
    """The host's library directories (inside the sandbox) for programs of `loader`: its own
    directory, its multiarch directories under /lib and /usr/lib, and those two."""
    real = os.path.realpath(loader)
    arch = os.path.basename(os.path.dirname(real))
    dirs = [os.path.dirname(real), f"/lib/{arch}", f"/usr/lib/{arch}", "/lib", "/usr/lib"]
    kept = [d for d in dict.fromkeys(dirs) if os.path.isdir(d)]
    return ":".join(inside(d) for d in kept)


def wrap(argv: Sequence[str], which: Callable[[str], str | None] = shutil.which,
         read: Callable[[str], bytes] = _head) -> list[str]:
    """`argv` (a host program and its arguments) as it runs inside an image."""
    program = argv[0] if "/" in argv[0] else which(argv[0])
    try:
        head = None if program is None else read(program)
    except OSError:
        head = None
    if program is None or head is None:
        raise HostProgramError(f"{argv[0]} is not installed on this machine, so it cannot be "
                               f"brought into the task's image; install it, or install it in "
                               f"the image (a Dockerfile) and name it there")
    loader = elf_interpreter(head)
    if loader is not None:
        return [inside(loader), "--inhibit-cache", "--library-path", library_path(loader),
                inside(program), *argv[1:]]
    if head[:4] == ELF_MAGIC:
        return [inside(program), *argv[1:]]  # static: runs anywhere
    interp = shebang(head)
    if interp is not None:
        if posixpath.basename(interp[0]) == "env" and len(interp) == 2:
            interp = interp[1].split()
        return wrap([*interp, program, *argv[1:]], which, read)
    raise HostProgramError(f"{program} is neither an executable nor a script with a `#!` line, "
                           f"so it cannot run inside the task's image; install the harness in "
                           f"the image (a Dockerfile) and name it there")


def host_shell_prelude(tools: Sequence[str], which: Callable[[str], str | None] = shutil.which,
                       ) -> str:
    """Shell functions that make `tools` (socat, grep...) the host's, for a script run by the
    host's shell inside an image."""
    lines = []
    for tool in tools:
        lines.append(f"{tool}() {{ {shlex.join(wrap([tool], which))} \"$@\"; }}")
    return "\n".join(lines) + "\n"
