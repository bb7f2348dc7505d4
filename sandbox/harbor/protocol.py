"""The messages between the runner (Python 3.11) and the Harbor worker (Python 3.12).

One JSON object per line. The runner sends a `TrialRequest` per rollout on the worker's stdin;
the worker answers each with a `TrialReply` carrying the same id, in whatever order trials end.
A `Cancel` stops a trial in flight; its reply still comes.
Both sides import only msgspec, so the file is shared as is.
"""

from __future__ import annotations

from typing import Any

import msgspec


class TrialRequest(msgspec.Struct, frozen=True, tag="trial"):
    id: int
    task_dir: str
    trial_name: str
    trials_dir: str
    agent: str  # a Harbor agent name, or module:Class
    model: str | None
    # Only the agent phase sees these (AgentConfig.env): the rollout's key and base URLs.
    agent_env: dict[str, str]
    agent_kwargs: dict[str, Any] = {}
    environment: str = "bwrap"  # "bwrap", a Harbor environment type, or module:Class
    environment_kwargs: dict[str, Any] = {}
    # The run's phase limits (sandbox/pools.py: setup, agent, verify; absent: no limit), the
    # same in every request of a run: the worker's pools take the first request's.
    pool_limits: dict[str, int] = {}


class SealReport(msgspec.Struct, frozen=True):
    """What the sealed channel said of one verifier phase (sandbox/harbor/seal.py).
    `runs`: the sealed pytest runs that started; `expected` (collect): each run's test node
    ids; `problem` (judge): why the report is not whole or the tests did not all run, None
    when it is; `passed`/`total`: the expected tests that passed, over every run."""

    mode: str
    runs: int
    expected: list[list[str]] = []
    problem: str | None = None
    passed: int = 0
    total: int = 0


class TrialReply(msgspec.Struct, frozen=True, tag="reply"):
    id: int
    rewards: dict[str, float] | None
    reward_valid: bool
    # Harbor's exception (type: message) and failure cause, when the trial recorded one.
    exception: str | None = None
    failure_cause: str | None = None
    # Seconds of each phase Harbor timed, by name (environment_setup, agent_execution, ...).
    phases: dict[str, float] = {}
    trial_dir: str | None = None
    # Seconds the trial queued for each phase's slot (sandbox/pools.py).
    queue_wait_s: dict[str, float] = {}
    # A failure of the worker itself around the trial (bad agent name, task that does not load).
    error: str | None = None
    # What the sealed channel said of the verifier's pytest runs (bwrap environment, seal on).
    seal: SealReport | None = None
    # The agent failed (type: message) and the verifier judged the workdir as it left it.
    agent_error: str | None = None


class Cancel(msgspec.Struct, frozen=True, tag="cancel"):
    """The rollout was interrupted: stop its trial (Harbor stops its environment)."""

    id: int


class Ready(msgspec.Struct, frozen=True, tag="ready"):
    harbor_version: str
    import_s: float


Message = TrialRequest | TrialReply | Cancel | Ready
encoder = msgspec.json.Encoder()
decoder = msgspec.json.Decoder(Message)


def encode(message: Message) -> bytes:
    return encoder.encode(message) + b"\n"


# The reward detail of a verifier phase that ran no sealed pytest (seal.py); the run summary
# names its tasks.
UNSEALED = "verdict unsealed: the tested code can change it"
