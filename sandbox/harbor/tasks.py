"""Harbor task directories as rolltap tasks.

A Harbor task is a directory with `task.toml`, `instruction.md`, `tests/` and, for the oracle,
`solution/`. Harbor itself reads and runs it (in the worker); the runner needs only its id, its
prompt (for the rollout's metadata), its timeouts (for the gateway's) and where it is.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from sandbox.tasks import Task, TaskFileError, Timeouts, Verifier

TASK_FILE = "task.toml"
# Harbor's defaults where task.toml leaves a timeout out.
DEFAULT_AGENT_S = 600.0
DEFAULT_VERIFIER_S = 600.0
DEFAULT_BUILD_S = 600.0
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def task_dirs(path: str) -> list[Path]:
    """`path` itself if it holds task.toml, else its subdirectories that do (sorted)."""
    root = Path(path)
    if (root / TASK_FILE).is_file():
        return [root.resolve()]
    found = sorted(p.parent.resolve() for p in root.glob(f"*/{TASK_FILE}"))
    if not found:
        raise TaskFileError(f"{path}: no {TASK_FILE} there or in its subdirectories: give a "
                            "Harbor task directory or a directory of them")
    return found


def load_task(directory: Path) -> Task:
    where = directory / TASK_FILE
    try:
        config = tomllib.loads(where.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise TaskFileError(f"{where}: {exc}") from exc
    if not _ID.match(directory.name):
        raise TaskFileError(f"{directory}: a task's directory name is its id and may hold "
                            "only letters, digits, '.', '_' and '-'")
    try:
        prompt = (directory / "instruction.md").read_text()
    except OSError as exc:
        raise TaskFileError(f"{directory}: no instruction.md ({exc.strerror})") from exc

    def seconds(table: str, key: str, default: float) -> float:
        value = config.get(table, {}).get(key, default)
        if not isinstance(value, int | float) or value <= 0:
            raise TaskFileError(f"{where}: [{table}] {key} must be a positive number")
        return float(value)

    return Task(
        id=directory.name,
        prompt=prompt,
        files={},
        # Harbor runs the task's tests/test.sh and reads its reward file; this is a label.
        verifier=Verifier(command="harbor", reward="script", files={}),
        timeouts=Timeouts(
            agent_s=seconds("agent", "timeout_sec", DEFAULT_AGENT_S),
            verifier_s=seconds("verifier", "timeout_sec", DEFAULT_VERIFIER_S),
            setup_s=seconds("environment", "build_timeout_sec", DEFAULT_BUILD_S),
        ),
        metadata={"harbor_task": directory.name, **config.get("metadata", {})},
        source_paths=(str(directory),),
    )


def load_harbor_tasks(path: str) -> list[Task]:
    return [load_task(d) for d in task_dirs(path)]
