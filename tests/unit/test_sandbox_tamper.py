"""Protected paths: whatever an agent does under them, and only there, is found."""

from __future__ import annotations

import os
import tempfile

from hypothesis import given, settings
from hypothesis import strategies as st

from sandbox.layout import write_files
from sandbox.tamper import changed

names = st.sampled_from(["tests/test_a.py", "tests/test_b.py", "tests/sub/test_c.py",
                         "conftest.py", "src/mod.py"])
trees = st.dictionaries(names, st.binary(max_size=20), min_size=1)
PROTECTED = ("tests", "conftest.py")
Edit = st.sampled_from(["rewrite", "remove", "add", "link", "none"])


def apply(work: str, name: str, edit: str) -> None:
    path = os.path.join(work, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if edit == "rewrite":
        with open(path, "ab") as fh:
            fh.write(b"!")
    elif edit == "remove" and os.path.exists(path):
        os.remove(path)
    elif edit == "add":
        with open(path + ".new", "wb") as fh:
            fh.write(b"x")
    elif edit == "link":
        if os.path.lexists(path):
            os.remove(path)
        os.symlink("/etc/hostname", path)


@settings(max_examples=60, deadline=None)
@given(trees, names, Edit)
def test_changes_are_found_exactly_under_protected_paths(files, name, edit):
    with tempfile.TemporaryDirectory() as work:
        write_files(work, files)
        assert changed(PROTECTED, files, work) == []
        apply(work, name, edit)
        target = name + ".new" if edit == "add" else name  # "add" makes a file next to it
        touched = [p for p in PROTECTED if target == p or target.startswith(p + "/")]
        noticeable = edit in ("rewrite", "add", "link") or (edit == "remove" and name in files)
        assert changed(PROTECTED, files, work) == (touched if noticeable else [])
