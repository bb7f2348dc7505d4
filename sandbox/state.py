"""The runner's state file: JSONL, a header with the run id, then one line per finished rollout,
keyed by (task, repeat, member). A resumed run skips the keys it finds and reuses the run id, so
the rollouts it still has to do join the groups their siblings already started.

Each line is flushed and fsynced before the rollout counts as done; a line torn by a crash is
ignored on load (its rollout is simply done again).
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

Key = tuple[str, int, int]


class RunHeader(msgspec.Struct, frozen=True, tag="run"):
    run_id: str
    created: float


class FinishedRollout(msgspec.Struct, frozen=True, tag="rollout"):
    task_id: str
    repeat: int
    member: int
    rollout_id: str
    group_id: str
    status: str  # as posted to the gateway: finished, failed, timeout
    sandbox_status: str  # ok, crashed, timeout, setup_failed, tampered, error (backend failed)
    reward: float | None
    reward_detail: str
    duration_s: float
    calls: int | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    trained_tokens: int | None = None
    host: str | None = None
    isolation: str | None = None  # bwrap, or none (the explicit opt-out)

    @property
    def key(self) -> Key:
        return (self.task_id, self.repeat, self.member)


StateLine = RunHeader | FinishedRollout


class StateFileError(ValueError):
    pass


def parse_state(text: str, source: str) -> tuple[RunHeader | None, dict[Key, FinishedRollout]]:
    decoder = msgspec.json.Decoder(StateLine)
    header: RunHeader | None = None
    done: dict[Key, FinishedRollout] = {}
    lines = text.split("\n")
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            item = decoder.decode(line)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            if lineno == len(lines):  # the final line, without its newline: torn by a crash
                break
            raise StateFileError(f"{source} line {lineno}: {exc}") from None
        if isinstance(item, RunHeader):
            header = header or item
        else:
            done[item.key] = item
    return header, done


class StateFile:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def load(self) -> tuple[RunHeader | None, dict[Key, FinishedRollout]]:
        if not self.path.exists():
            return None, {}
        text = self.path.read_text(encoding="utf-8")
        if text and not text.endswith("\n"):
            # Cut the torn line off, so the next append starts a line of its own.
            keep = text.rfind("\n") + 1
            os.truncate(self.path, len(text[:keep].encode()))
        return parse_state(text, str(self.path))

    def append(self, item: StateLine) -> None:
        # O_APPEND keeps concurrent appends of whole lines intact; fsync makes "recorded" mean
        # "survives a crash".
        data = msgspec.json.encode(item) + b"\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)


def unscorable_cause(detail: str, status: str) -> str:
    """Why a rollout has no reward, in a word: the cause its detail names after
    `unscorable:` (Harbor's failure cause, `unanswered`), else its sandbox status. Pure."""
    if detail.startswith("unscorable: "):
        return detail.removeprefix("unscorable: ").split(":", 1)[0].strip() or "unscorable"
    return status
