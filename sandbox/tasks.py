"""Task files: one JSON task per line, decoded and validated, with file trees read into memory.

A task line names its starting files and its hidden tests either inline or as a directory next
to the task file. Loading resolves both into `{relative path: bytes}` maps, so a `Task` is
self-contained: it can be pickled to another machine (Ray) where the task directory does not
exist. It also records where the task set was read from, so that a sandbox can hide those
paths from the agent.
"""

from __future__ import annotations

import os
import re
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Literal

import msgspec

from sandbox.images import Build, ImageError, load_build
from sandbox.pytest_report import pytest_command, runs_pytest

RewardKind = Literal["pytest", "binary", "script"]
TaskId = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", max_length=200)]
Seconds = Annotated[float, msgspec.Meta(gt=0)]


class TaskFileError(ValueError):
    """A task file that cannot be used; the message names the file, the line and the field."""


# ---- the wire shape of one line -------------------------------------------------------------


class VerifierSpec(msgspec.Struct, forbid_unknown_fields=True):
    command: str
    reward: RewardKind = "pytest"
    files: dict[str, str] | None = None
    files_dir: str | None = None


class Timeouts(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    agent_s: Seconds = 600.0
    verifier_s: Seconds = 120.0
    setup_s: Seconds = 120.0


class TaskSpec(msgspec.Struct, forbid_unknown_fields=True):
    id: TaskId
    prompt: str
    verifier: VerifierSpec
    files: dict[str, str] | None = None
    files_dir: str | None = None
    setup: str | None = None
    timeouts: Timeouts = msgspec.field(default_factory=Timeouts)
    metadata: dict[str, Any] = {}
    # Paths (files or directories, relative to the workdir) of the starting files the agent
    # must leave as they are, such as its own tests or a conftest.py: any change scores 0 with
    # status `tampered`, and the verifier sees the originals.
    protected: list[str] = []
    # The task's own root filesystem (sandbox/images.py): an image reference looked up in
    # containers-storage (pulled when missing), or a directory (relative to the task file)
    # holding a Dockerfile and its build context. Neither: the machine's own system.
    image: str | None = None
    dockerfile_dir: str | None = None


# ---- the resolved, self-contained task ------------------------------------------------------


class Verifier(msgspec.Struct, frozen=True):
    command: str
    reward: RewardKind
    files: dict[str, bytes]


class Task(msgspec.Struct, frozen=True):
    id: str
    prompt: str
    files: dict[str, bytes]
    verifier: Verifier
    setup: str | None = None
    timeouts: Timeouts = Timeouts()
    metadata: dict[str, Any] = {}
    protected: tuple[str, ...] = ()
    # Resolved paths the task set was read from: the task file and every files_dir of any of
    # its tasks. They hold hidden tests (this task's and its siblings'), so the agent must not
    # see them.
    source_paths: tuple[str, ...] = ()
    image: str | None = None
    build: Build | None = None


# ---- pure checks ----------------------------------------------------------------------------

_TYPE_WORDS = {
    "str": "a string",
    "int": "an integer",
    "float": "a number",
    "bool": "a boolean",
    "object": "an object",
    "array": "an array",
    "null": "null",
}
_EXPECTED = re.compile(r"^Expected `([^`]*)`(.*?)(?: - at `\$([^`]*)`)?$")
_MISSING = re.compile(r"^Object missing required field `([^`]*)`(?: - at `\$([^`]*)`)?$")
_UNKNOWN = re.compile(r"^Object contains unknown field `([^`]*)`(?: - at `\$([^`]*)`)?$")
_INVALID = re.compile(r"^Invalid enum value (.*?)(?: - at `\$([^`]*)`)?$")


def _type_words(spec: str) -> str:
    return " or ".join(_TYPE_WORDS.get(part.strip(), part.strip()) for part in spec.split("|"))


def _field(path: str | None, name: str | None = None) -> str:
    dotted = (path or "").lstrip(".")
    if name:
        dotted = f"{dotted}.{name}" if dotted else name
    return dotted or "(line)"


def describe_validation_error(message: str) -> str:
    """Turn msgspec's validation message into `field "a.b": what was wrong`."""
    if m := _EXPECTED.match(message):
        spec, rest, path = m.groups()
        got = re.match(r", got `([^`]*)`", rest)
        if got:
            return (
                f'field "{_field(path)}": expected {_type_words(spec)}, '
                f"got {_TYPE_WORDS.get(got.group(1), got.group(1))}"
            )
        return f'field "{_field(path)}": expected {_type_words(spec)}{rest}'
    if m := _MISSING.match(message):
        return f'field "{_field(m.group(2), m.group(1))}": required field is missing'
    if m := _UNKNOWN.match(message):
        return f'field "{_field(m.group(2), m.group(1))}": unknown field'
    if m := _INVALID.match(message):
        return f'field "{_field(m.group(2))}": invalid value {m.group(1)}'
    return message


def check_relative_path(name: str) -> str | None:
    """Why `name` cannot be a file inside a sandbox, or None if it can.

    Files are written under the sandbox's workdir; an absolute name or a `..` part would let a
    task file write anywhere on the machine.
    """
    if not name or "\x00" in name or "\\" in name:
        return "not a usable relative path"
    path = PurePosixPath(name)
    if path.is_absolute():
        return "absolute paths are not allowed"
    if ".." in path.parts:
        return "'..' is not allowed"
    if str(path) in ("", "."):
        return "not a usable relative path"
    return None


def _line_error(source: str, lineno: int, detail: str) -> TaskFileError:
    return TaskFileError(f"{source} line {lineno}: {detail}")


# ---- loading --------------------------------------------------------------------------------


def _read_tree(base: Path, rel: str, field: str, source: str, lineno: int) -> dict[str, bytes]:
    if problem := check_relative_path(rel):
        raise _line_error(source, lineno, f'field "{field}": {problem}')
    root = base / rel
    if not root.is_dir():
        raise _line_error(source, lineno, f'field "{field}": directory not found: {rel}')
    files: dict[str, bytes] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        # Bytecode caches appear as soon as someone runs the hidden tests by hand; they are
        # never part of a task.
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for fname in sorted(filenames):
            full = Path(dirpath) / fname
            name = full.relative_to(root).as_posix()
            if full.is_symlink() or not full.is_file():
                raise _line_error(
                    source, lineno, f'field "{field}": {name} is not a regular file'
                )
            files[name] = full.read_bytes()
    return files


def _inline(files: dict[str, str], field: str, source: str, lineno: int) -> dict[str, bytes]:
    out = {}
    for name, content in files.items():
        if problem := check_relative_path(name):
            raise _line_error(source, lineno, f'field "{field}": file name {name!r}: {problem}')
        out[str(PurePosixPath(name))] = content.encode()
    return out


def _files(
    inline: dict[str, str] | None,
    directory: str | None,
    field: str,
    base: Path,
    source: str,
    lineno: int,
) -> dict[str, bytes]:
    if inline is not None and directory is not None:
        raise _line_error(
            source, lineno, f'fields "{field}files" and "{field}files_dir": give one, not both'
        )
    if directory is not None:
        return _read_tree(base, directory, f"{field}files_dir", source, lineno)
    return _inline(inline or {}, f"{field}files", source, lineno)


def resolve_task(spec: TaskSpec, base: Path, source: str, lineno: int) -> Task:
    """Validate what msgspec cannot (paths, exclusive fields) and read the file trees."""
    files = _files(spec.files, spec.files_dir, "", base, source, lineno)
    hidden = _files(
        spec.verifier.files, spec.verifier.files_dir, "verifier.", base, source, lineno
    )
    if not spec.verifier.command.strip():
        raise _line_error(source, lineno, 'field "verifier.command": must not be empty')
    if spec.verifier.reward == "binary" and runs_pytest(spec.verifier.command):
        raise _line_error(source, lineno, 'field "verifier.reward": "binary" trusts the exit '
                          "status, which the tested code controls (os._exit(0) at import "
                          'passes): a pytest command takes reward "pytest", which runs it '
                          "sealed")
    if spec.verifier.reward == "pytest":
        try:
            pytest_command(spec.verifier.command)
        except ValueError as exc:
            raise _line_error(source, lineno, f'field "verifier.command": {exc}') from None
    protected = []
    for name in spec.protected:
        if problem := check_relative_path(name):
            raise _line_error(source, lineno, f'field "protected": {name!r}: {problem}')
        protected.append(str(PurePosixPath(name)))
    if spec.image is not None and spec.dockerfile_dir is not None:
        raise _line_error(source, lineno,
                          'fields "image" and "dockerfile_dir": give one, not both')
    if spec.image is not None and not spec.image.strip():
        raise _line_error(source, lineno, 'field "image": must not be empty')
    build = None
    if spec.dockerfile_dir is not None:
        if problem := check_relative_path(spec.dockerfile_dir):
            raise _line_error(source, lineno, f'field "dockerfile_dir": {problem}')
        try:
            build = load_build(str(base / spec.dockerfile_dir))
        except (ImageError, OSError) as exc:
            raise _line_error(source, lineno, f'field "dockerfile_dir": {exc}') from None
    return Task(
        id=spec.id,
        prompt=spec.prompt,
        files=files,
        verifier=Verifier(spec.verifier.command, spec.verifier.reward, hidden),
        setup=spec.setup,
        timeouts=spec.timeouts,
        metadata=spec.metadata,
        protected=tuple(protected),
        image=spec.image,
        build=build,
    )


def protected_files(task: Task) -> dict[str, bytes]:
    """The starting files under the task's protected paths."""
    return {name: data for name, data in task.files.items()
            if any(name == p or name.startswith(p + "/") for p in task.protected)}


def _tree_dirs(spec: TaskSpec, base: Path) -> list[str]:
    named = (spec.files_dir, spec.verifier.files_dir, spec.dockerfile_dir)
    return [os.path.realpath(base / d) for d in named if d is not None]


def parse_tasks(
    text: str, base: Path, source: str, task_file: str | os.PathLike[str] | None = None
) -> list[Task]:
    """Parse JSONL task text; `base` is the directory `files_dir` entries are relative to,
    `task_file` the file the text came from (recorded in `Task.source_paths`)."""
    decoder = msgspec.json.Decoder(TaskSpec)
    tasks: list[Task] = []
    seen: dict[str, int] = {}
    sources = {os.path.realpath(task_file)} if task_file is not None else set()
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            spec = decoder.decode(line)
        except msgspec.ValidationError as exc:
            raise _line_error(source, lineno, describe_validation_error(str(exc))) from None
        except msgspec.DecodeError as exc:
            raise _line_error(source, lineno, f"not valid JSON: {exc}") from None
        if spec.id in seen:
            raise _line_error(
                source, lineno, f'field "id": duplicate id {spec.id!r} (first on line '
                f"{seen[spec.id]})"
            )
        seen[spec.id] = lineno
        tasks.append(resolve_task(spec, base, source, lineno))
        sources.update(_tree_dirs(spec, base))
    if not tasks:
        raise TaskFileError(f"{source}: no tasks")
    paths = tuple(sorted(sources))
    return [msgspec.structs.replace(task, source_paths=paths) for task in tasks]


def load_tasks(path: str | os.PathLike[str]) -> list[Task]:
    """Read and validate a JSONL task file. Raises TaskFileError naming the line and field."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise TaskFileError(f"{path}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise TaskFileError(f"{path}: not UTF-8 text: {exc}") from None
    return parse_tasks(text, path.parent, str(path), task_file=path)
