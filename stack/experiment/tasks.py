"""Task sets of the learning experiment (pure, deterministic from a seed): template instances
as lines of the project's task format (sandbox/tasks.py), with hidden pytest tests.

Every task's hidden tests are two structural tests (the module imports without printing; it
defines the requested function) and four logic tests (one argument tuple each), so the
`pytest` reward (the fraction passed) gives partial credit for structure, and a rollout
passes (pass@1) only when all six pass. The same cases ride in `metadata.cases`, where the
experiment's evaluation (stack/experiment/check.py) grades replies without a sandbox.

Train and held-out sets are instances of the same templates drawn from disjoint random
streams (split by instance); out-of-distribution templates appear only in held-out sets.
The positive-control variant keeps the prompt and replaces the reward by a length target on
the agent's reply (`reply_length_reward`).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from stack.experiment.templates import ALL, Instance, draw

LOGIC_CASES = 4
CONFTEST = "# Replaces any conftest.py the agent wrote: pytest would load it into the verifier.\n"
PYTEST_INI = "[pytest]\npythonpath = .\ntestpaths = tests_hidden\naddopts = -p no:cacheprovider\n"
PYTEST_COMMAND = "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -I -m pytest -q"
REPLY_FILE = "agent_reply.md"  # where sandbox.agents.code_writer keeps the model's reply

# The positive control's reward: 1 at exactly TARGET characters of reply, falling linearly to 0
# at 0 and at twice the target. Read by a verifier script from the reply the agent kept.
LENGTH_SCRIPT = """import pathlib
TARGET = {target}
try:
    n = len(pathlib.Path("{reply}").read_text())
except OSError:
    n = 0
print(max(0.0, 1.0 - abs(n - TARGET) / TARGET))
"""


def reply_length_reward(reply: str, target: int) -> float:
    """The positive control's reward of `reply` (the verifier script computes the same)."""
    return max(0.0, 1.0 - abs(len(reply) - target) / target)


def _call(func: str, args: tuple[Any, ...]) -> str:
    return f"{func}({', '.join(repr(a) for a in args)})"


def prompt(inst: Instance) -> str:
    examples = "; ".join(f"{_call(inst.func, a)} returns {inst.evaluate(a)!r}"
                         for a in inst.cases[:2])
    return (f"Implement {inst.func}({inst.signature}) in {inst.func}.py. {inst.doc} "
            f"For example: {examples}.")


def stub(inst: Instance) -> str:
    return (f"def {inst.func}({inst.signature}) -> {inst.returns}:\n"
            f"    \"\"\"{inst.doc}\"\"\"\n    raise NotImplementedError\n")


def hidden_tests(inst: Instance) -> str:
    head = f'''import contextlib
import importlib
import io
import sys

MODULE, FUNC = {inst.func!r}, {inst.func!r}


def _load():
    sys.modules.pop(MODULE, None)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        module = importlib.import_module(MODULE)
    return module, printed.getvalue()


def test_structure_imports_quietly():
    assert _load()[1] == "", "the module prints when imported"


def test_structure_defines_function():
    assert callable(getattr(_load()[0], FUNC, None)), "the requested function is not defined"
'''
    logic = [f"\n\ndef test_logic_{i}():\n    assert getattr(_load()[0], FUNC)(*{args!r}) == "
             f"{inst.evaluate(args)!r}\n" for i, args in enumerate(logic_args(inst))]
    return head + "".join(logic)


def logic_args(inst: Instance) -> tuple[tuple[Any, ...], ...]:
    return inst.cases[2:2 + LOGIC_CASES]


def task_line(inst: Instance, task_id: str, split: str, *, ood: bool) -> dict[str, Any]:
    """`inst` as one task of the project's task format (inline files)."""
    return {
        "id": task_id,
        "prompt": prompt(inst),
        "files": {f"{inst.func}.py": stub(inst)},
        "verifier": {
            "files": {"conftest.py": CONFTEST, "pytest.ini": PYTEST_INI,
                      f"tests_hidden/test_{inst.func}.py": hidden_tests(inst)},
            "command": PYTEST_COMMAND, "reward": "pytest"},
        "timeouts": {"agent_s": 600, "verifier_s": 60},
        "metadata": {"split": split, "template": inst.template, "ood": ood, "func": inst.func,
                     "cases": [[list(a), inst.evaluate(a)] for a in logic_args(inst)]},
    }


def length_variant(task: dict[str, Any], target: int) -> dict[str, Any]:
    """The positive control's version of `task`: same prompt, reward = reply length target."""
    return {**task, "verifier": {
        "files": {"score_length.py": LENGTH_SCRIPT.format(target=target, reply=REPLY_FILE)},
        "command": "python -I score_length.py", "reward": "script"},
        "metadata": {**task["metadata"], "reward": "length", "length_target": target}}


def generate(seed: int, split: str, templates: Iterable[str], per_template: int, *,
             ood: bool = False, exclude: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    """`per_template` tasks of each template, drawn from a stream named by (seed, split,
    template, index): the same arguments give the same tasks. Instances whose prompt is in
    `exclude` (another split's) are skipped, so splits never share a task."""
    tasks = []
    for template in templates:
        if template not in ALL:
            raise ValueError(f"unknown template {template!r}; known: {', '.join(ALL)}")
        index = made = 0
        while made < per_template:
            inst = draw(template, random.Random(f"{seed}/{split}/{template}/{index}"))
            index += 1
            task = task_line(inst, f"{template}-{split}-{made}", split, ood=ood)
            if task["prompt"] in exclude:
                continue
            tasks.append(task)
            made += 1
    return tasks


def prompts(tasks: Iterable[dict[str, Any]]) -> frozenset[str]:
    return frozenset(t["prompt"] for t in tasks)


def write_tasks(path: Path, tasks: Iterable[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    return path


def read_tasks(path: Path) -> list[dict[str, Any]]:
    """The tasks of a task file, each with `metadata.cases` and `metadata.func` (the evaluation
    grades by them); a line without them is refused with its number."""
    tasks = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        task = json.loads(line)
        meta = task.get("metadata", {})
        if not isinstance(meta.get("cases"), list) or not isinstance(meta.get("func"), str):
            raise ValueError(f"{path} line {n}: the evaluation needs metadata.func (the function "
                             "name) and metadata.cases ([[args], expected] pairs)")
        tasks.append(task)
    return tasks
