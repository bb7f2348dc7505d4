"""Processes of this machine, read from /proc."""

from __future__ import annotations

import os
from pathlib import Path


def alive_with(marker: str) -> list[int]:
    """Processes whose command line holds `marker` and that are not zombies."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry.name}/cmdline").read_bytes()
            stat = Path(f"/proc/{entry.name}/stat").read_text()
        except OSError:
            continue
        if marker.encode() in cmdline and stat[stat.rindex(")") + 2] != "Z":
            found.append(int(entry.name))
    return found


def ancestors(pid: int) -> list[int]:
    """`pid`'s parents up to init, read from /proc (empty once it is gone)."""
    chain = []
    while pid > 1:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat[stat.rindex(")") + 2:].split()[1])
        chain.append(pid)
    return chain


def describe(pids: list[int]) -> str:
    """Each process's command line and its parents' names, for a failure message."""
    def comm(pid: int) -> str:
        try:
            return Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            return "?"

    lines = []
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
                errors="replace")
        except OSError:
            cmdline = "(gone)"
        parents = " < ".join(f"{p}:{comm(p)}" for p in ancestors(pid))
        lines.append(f"{pid} {cmdline[:200]}\n    parents: {parents}")
    return "\n".join(lines)
