"""Did the agent change what it must not? A task's `protected` paths (its own tests, a
conftest.py) must be, after the agent, exactly the starting files under them: the same regular
files with the same bytes, nothing added, nothing replaced by a link."""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping, Sequence


def _matches(path: str, expected: bytes) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISREG(st.st_mode) or st.st_size != len(expected):
        return False
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as fh:
        return fh.read(len(expected) + 1) == expected


def _found(work: str, top: str) -> set[str]:
    """Relative names of everything but real directories under `top` (or `top` itself if it
    is no directory)."""
    full = os.path.join(work, top)
    try:
        st = os.lstat(full)
    except FileNotFoundError:
        return set()
    if not stat.S_ISDIR(st.st_mode):
        return {top}
    names = set()
    for dirpath, dirnames, filenames in os.walk(full):
        # os.walk lists links to directories among dirnames without entering them.
        for name in [*dirnames, *filenames]:
            path = os.path.join(dirpath, name)
            if os.path.islink(path) or not os.path.isdir(path):
                names.add(os.path.relpath(path, work))
    return names


def changed(protected: Sequence[str], originals: Mapping[str, bytes], work: str) -> list[str]:
    """The protected paths whose content in `work` is not exactly `originals` under them."""
    out = []
    for top in protected:
        expected = {n: d for n, d in originals.items() if n == top or n.startswith(top + "/")}
        found = _found(work, top)
        if found != set(expected) or not all(
                _matches(os.path.join(work, n), d) for n, d in expected.items()):
            out.append(top)
    return out
