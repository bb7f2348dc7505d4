"""A minimal init for one sandboxed command: `python -I -S reaper.py ARGV...`.

It becomes the child subreaper of its subtree, runs ARGV, and when ARGV exits (or the reaper
gets SIGTERM/SIGINT/SIGHUP) kills every remaining descendant, including those that left the
process group with setsid, and reaps them all. Without it, a harness's background children
outlive the harness, and on machines whose PID 1 does not reap, every killed orphan stays a
zombie. Exits with ARGV's exit code, or 128 + the signal that ended it.

Standard library only and importable as a plain file: it runs before anything else in the
sandbox, with no site-packages.
"""

import ctypes
import os
import signal
import sys
import time

PR_SET_CHILD_SUBREAPER = 36


class Stop(Exception):
    def __init__(self, signum: int) -> None:
        self.signum = signum


def _on_signal(signum, frame):
    raise Stop(signum)


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        # The command name may hold spaces and parentheses; the parent pid follows its last ')'.
        ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(name))
    found, stack = [], [root]
    while stack:
        for child in children.get(stack.pop(), ()):
            found.append(child)
            stack.append(child)
    return found


def reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def kill_tree(rounds: int = 400) -> None:
    me = os.getpid()
    for _ in range(rounds):
        pids = descendants(me)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        reap()
        time.sleep(0.005)


def main(argv: list[str]) -> int:
    if not argv:
        sys.stderr.write("usage: reaper.py COMMAND [ARG...]\n")
        return 2
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    child = os.fork()
    if child == 0:
        try:
            os.execvp(argv[0], argv)
        except OSError as exc:
            sys.stderr.write(f"rolltap sandbox: cannot run {argv[0]!r}: {exc.strerror}\n")
            os._exit(127)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, _on_signal)
    code = 1
    try:
        while True:
            pid, status = os.wait()
            if pid == child:
                code = os.waitstatus_to_exitcode(status)
                code = 128 - code if code < 0 else code
                break
    except Stop as stop:
        code = 128 + stop.signum
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    kill_tree()
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
