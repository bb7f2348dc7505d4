"""Task files: decoding, validation errors that name the line and the field, file trees."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sandbox.tasks import (
    TaskFileError,
    check_relative_path,
    describe_validation_error,
    load_tasks,
    parse_tasks,
)

REPO = Path(__file__).resolve().parents[2]

GOOD = {"id": "t1", "prompt": "do it", "files": {"a.py": "x = 1\n"},
        "verifier": {"command": "pytest -q", "files": {"tests/test_a.py": "def test(): pass\n"}}}


def jsonl(*docs) -> str:
    return "".join((d if isinstance(d, str) else json.dumps(d)) + "\n" for d in docs)


def error_of(text: str, base: Path = Path(".")) -> str:
    with pytest.raises(TaskFileError) as info:
        parse_tasks(text, base, "tasks.jsonl")
    return str(info.value)


def with_(doc: dict, path: str, value) -> dict:
    doc = json.loads(json.dumps(doc))
    *parents, last = path.split(".")
    target = doc
    for p in parents:
        target = target[p]
    target[last] = value
    return doc


def test_good_task_decodes():
    (task,) = parse_tasks(jsonl(GOOD), Path("."), "tasks.jsonl")
    assert task.files == {"a.py": b"x = 1\n"}
    assert task.verifier.files == {"tests/test_a.py": b"def test(): pass\n"}
    assert task.verifier.reward == "pytest"
    assert (task.timeouts.agent_s, task.timeouts.verifier_s) == (600.0, 120.0)


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        (with_(GOOD, "verifier.command", 3),
         'tasks.jsonl line 3: field "verifier.command": expected a string, got an integer'),
        (with_(GOOD, "verifier.reward", "vibes"),
         "tasks.jsonl line 3: field \"verifier.reward\": invalid value 'vibes'"),
        (with_(GOOD, "timeouts", {"agent_s": 0}),
         'tasks.jsonl line 3: field "timeouts.agent_s": expected a number > 0.0'),
        (with_(GOOD, "timeouts", {"agent_s": 5, "wall_s": 3}),
         'tasks.jsonl line 3: field "timeouts.wall_s": unknown field'),
        ({k: v for k, v in GOOD.items() if k != "prompt"},
         'tasks.jsonl line 3: field "prompt": required field is missing'),
        (with_(GOOD, "verifier", {"files": {}}),
         'tasks.jsonl line 3: field "verifier.command": required field is missing'),
        (with_(GOOD, "id", "has space"),
         'tasks.jsonl line 3: field "id": expected a string matching regex'),
        (with_(GOOD, "files", {"/etc/passwd": "x"}),
         "tasks.jsonl line 3: field \"files\": file name '/etc/passwd': absolute paths"),
        (with_(GOOD, "verifier.files", {"../escape.py": "x"}),
         "tasks.jsonl line 3: field \"verifier.files\": file name '../escape.py': '..' is not"),
        (with_(GOOD, "files_dir", "start"),
         'tasks.jsonl line 3: fields "files" and "files_dir": give one, not both'),
        (with_(GOOD, "verifier.command", "  "),
         'tasks.jsonl line 3: field "verifier.command": must not be empty'),
        (with_(GOOD, "protected", ["tests/../../x"]),
         "tasks.jsonl line 3: field \"protected\": 'tests/../../x': '..' is not"),
        (with_(GOOD, "protected", "tests"),
         'tasks.jsonl line 3: field "protected": expected an array, got a string'),
        ("{not json",
         "tasks.jsonl line 3: not valid JSON"),
        (with_(GOOD, "verifier.reward", "binary"),
         'tasks.jsonl line 3: field "verifier.reward": "binary" trusts the exit status'),
        (with_(with_(GOOD, "verifier.reward", "binary"), "verifier.command",
               "cd src && python3 -m pytest -x"),
         'tasks.jsonl line 3: field "verifier.reward": "binary" trusts the exit status'),
    ],
)
def test_errors_name_line_and_field(doc, message):
    other = with_(GOOD, "id", "t0")
    assert error_of(jsonl(other, "", doc)).startswith(message)


def test_protected_paths_are_normalised():
    [task] = parse_tasks(jsonl(with_(GOOD, "protected", ["tests/", "./conftest.py"])),
                         Path("."), "tasks.jsonl")
    assert task.protected == ("tests", "conftest.py")


def test_duplicate_id_names_both_lines():
    assert error_of(jsonl(GOOD, GOOD)) == (
        "tasks.jsonl line 2: field \"id\": duplicate id 't1' (first on line 1)"
    )


def test_empty_file_is_an_error():
    assert error_of("\n\n") == "tasks.jsonl: no tasks"


def test_files_dir_is_read_relative_to_the_task_file(tmp_path):
    (tmp_path / "t" / "start" / "pkg").mkdir(parents=True)
    (tmp_path / "t" / "start" / "pkg" / "mod.py").write_text("A = 1\n")
    (tmp_path / "t" / "start" / "__pycache__").mkdir()
    (tmp_path / "t" / "start" / "__pycache__" / "mod.pyc").write_bytes(b"\0")
    (tmp_path / "t" / "hidden").mkdir()
    (tmp_path / "t" / "hidden" / "test_mod.py").write_text("def test(): pass\n")
    doc = {"id": "t", "prompt": "p", "files_dir": "t/start",
           "verifier": {"command": "pytest", "files_dir": "t/hidden"}}
    (tmp_path / "tasks.jsonl").write_text(jsonl(doc))
    (task,) = load_tasks(tmp_path / "tasks.jsonl")
    assert task.files == {"pkg/mod.py": b"A = 1\n"}
    assert task.verifier.files == {"test_mod.py": b"def test(): pass\n"}


def test_files_dir_errors(tmp_path):
    doc = {"id": "t", "prompt": "p", "files_dir": "missing", "verifier": {"command": "x"}}
    assert error_of(jsonl(doc), tmp_path) == (
        'tasks.jsonl line 1: field "files_dir": directory not found: missing'
    )
    doc["files_dir"] = "../elsewhere"
    assert error_of(jsonl(doc), tmp_path) == (
        "tasks.jsonl line 1: field \"files_dir\": '..' is not allowed"
    )
    (tmp_path / "start").mkdir()
    (tmp_path / "start" / "link").symlink_to("/etc/hostname")
    doc["files_dir"] = "start"
    assert error_of(jsonl(doc), tmp_path) == (
        'tasks.jsonl line 1: field "files_dir": link is not a regular file'
    )


def test_unreadable_file(tmp_path):
    with pytest.raises(TaskFileError, match="cannot read"):
        load_tasks(tmp_path / "nope.jsonl")


def test_example_task_set_loads():
    tasks = load_tasks(REPO / "examples" / "tasks" / "tasks.jsonl")
    assert len(tasks) >= 4
    for task in tasks:
        assert task.verifier.reward == "pytest"
        assert any(name.startswith("tests_hidden/test_") for name in task.verifier.files)
        # Hidden tests are never among the starting files.
        assert not set(task.files) & set(task.verifier.files)


names = st.lists(st.text(st.characters(codec="utf-8", exclude_characters="/\x00\\"),
                         min_size=1, max_size=8), min_size=1, max_size=4)


@given(names)
def test_relative_paths_without_dotdot_are_accepted(parts):
    name = "/".join(parts)
    ok = check_relative_path(name) is None
    assert ok == (".." not in parts and set(parts) != {"."})


@given(names)
def test_absolute_paths_are_rejected(parts):
    assert check_relative_path("/" + "/".join(parts)) is not None


@given(st.lists(st.sampled_from(["a", "b_c", "files", "verifier"]), min_size=1, max_size=4),
       st.sampled_from(["str", "int", "float", "object", "array", "bool", "null"]),
       st.sampled_from(["str", "int", "float", "object", "array", "bool", "null"]))
def test_describe_type_errors(path, expected, got):
    message = f"Expected `{expected}`, got `{got}` - at `$.{'.'.join(path)}`"
    described = describe_validation_error(message)
    assert described.startswith(f'field "{".".join(path)}": expected ')
    assert ", got " in described
