"""What a sandbox backend is given and what it returns. Both are plain msgspec records so a
backend can run the sandbox on another machine (Ray) and send the result back."""

from __future__ import annotations

from typing import Literal, Protocol

import msgspec

from sandbox.gateway_client import GatewayStatus, RolloutAccess
from sandbox.presets import Harness
from sandbox.process import ProcessOutcome
from sandbox.state import unscorable_cause
from sandbox.tasks import Task
from sandbox.verifier import VerifierResult

CrashReward = Literal["zero", "null", "verify"]
# tampered: the agent changed a protected path, or the tested code wrote into the verifier's
# report channel; scores 0.
SandboxStatus = Literal["ok", "crashed", "timeout", "setup_failed", "tampered"]
# bwrap: every phase confined (confine.py). none: the explicit opt-out, shown in the summary.
# harbor: a Harbor backend other than rolltap's own (podman, Daytona, ...) confines it.
Isolation = Literal["bwrap", "none", "harbor"]

ERROR_TAIL = 2000


class SandboxRequest(msgspec.Struct, frozen=True):
    task: Task
    harness: Harness
    access: RolloutAccess
    # What a crashed or timed-out agent scores: 0.0, None (unscorable), or whatever the
    # verifier finds in the workdir it left.
    crash_reward: CrashReward = "zero"
    # Paths of the runner's own that the agent must not see besides the task's sources (the
    # runner's state file).
    private_paths: tuple[str, ...] = ()


class SandboxResult(msgspec.Struct, frozen=True):
    status: SandboxStatus
    reward: float | None
    reward_detail: str
    host: str
    agent: ProcessOutcome | None = None
    setup: ProcessOutcome | None = None
    verifier: VerifierResult | None = None
    isolation: Isolation = "none"
    warnings: tuple[str, ...] = ()
    # Backend-specific facts for the rollout's metrics (Harbor: phases, extra reward keys).
    extra_metrics: dict = {}
    # The agent failed and its work was judged: that holds only if the gateway answered one of
    # its calls (the model's doing); else the runner makes it unscorable (the infrastructure's).
    agent_failed: bool = False

    @property
    def gateway_status(self) -> GatewayStatus:
        statuses: dict[str, GatewayStatus] = {
            "ok": "finished", "tampered": "finished", "timeout": "timeout"}
        return statuses.get(self.status, "failed")

    def metrics(self) -> dict:
        """What the runner posts with the reward: enough to tell why a rollout scored what it
        did without the sandbox."""
        m: dict = {"sandbox_status": self.status, "reward_detail": self.reward_detail,
                   "host": self.host, "isolation": self.isolation}
        if self.reward is None:  # counted by cause at the gateway (/metrics)
            m["unscorable_cause"] = unscorable_cause(self.reward_detail, self.status)
        if self.warnings:
            m["warnings"] = list(self.warnings)
        m |= self.extra_metrics
        failed = self.agent if self.status != "setup_failed" else self.setup
        if self.agent is not None:
            m |= {
                "exit_code": self.agent.exit_code,
                "agent_s": round(self.agent.duration_s, 3),
                "stdout_bytes": self.agent.stdout_bytes,
                "stderr_bytes": self.agent.stderr_bytes,
                "output_truncated": self.agent.output_truncated,
                "peak_pids": self.agent.peak_pids,
                "peak_memory_mb": self.agent.peak_memory_mb,
                "cgroup": list(self.agent.cgroup),
            }
        if self.verifier is not None:
            m |= {
                "verifier_s": round(self.verifier.duration_s, 3),
                "verifier_status": self.verifier.status,
                "tests_passed": self.verifier.passed,
                "tests_total": self.verifier.total,
            }
        if self.status != "ok" and failed is not None:
            m["stderr_tail"] = failed.stderr[-ERROR_TAIL:]
        return m


def decide_reward(
    status: SandboxStatus, crash_reward: CrashReward, verifier: VerifierResult | None
) -> tuple[float | None, str]:
    """The rollout's reward from how the agent ended and what the verifier found. Pure."""
    if status == "setup_failed":
        return None, "task setup failed"
    if status == "tampered":
        return 0.0, verifier.detail if verifier is not None else "tampered"
    if status == "ok" or crash_reward == "verify":
        assert verifier is not None, "the verifier runs whenever its result is used"
        prefix = "" if status == "ok" else f"agent {status}; "
        return verifier.reward, prefix + verifier.detail
    return (0.0 if crash_reward == "zero" else None), f"agent {status}"


def needs_verifier(status: SandboxStatus, crash_reward: CrashReward) -> bool:
    return status == "ok" or (status in ("crashed", "timeout") and crash_reward == "verify")


class Backend(Protocol):
    async def run(self, request: SandboxRequest) -> SandboxResult: ...

    async def aclose(self) -> None:
        """Ends what the backend keeps between sandboxes (Harbor's worker process)."""
        ...
