"""The Harbor worker: runs Harbor trials for the runner, in Harbor's own Python 3.12 venv.

Started once per `rolltap rollouts` run (`.venv-harbor/bin/python -m sandbox.harbor.worker`):
importing Harbor's agent layer costs seconds (litellm), so one process serves every trial of a
run, trials running concurrently on its event loop. It reads `TrialRequest` lines on stdin and
writes a `TrialReply` line per trial; everything Harbor itself prints goes to stderr, so the
protocol's stdout stays clean. One request is one trial, run once: nothing here retries, so a
failed trial is one failed rollout. EOF on stdin ends the worker after the trials in flight.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

# Harbor reaches for the network at import unless told not to (telemetry, litellm's cost map).
os.environ.setdefault("HARBOR_TELEMETRY", "0")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import asyncio  # noqa: E402

from sandbox.harbor.protocol import (  # noqa: E402
    Cancel,
    Ready,
    TrialReply,
    TrialRequest,
    decoder,
    encode,
)

BWRAP = "sandbox.harbor.environment:BwrapEnvironment"


def _environment_config(request: TrialRequest):
    from harbor.models.environment_type import EnvironmentType
    from harbor.models.trial.config import EnvironmentConfig

    name = BWRAP if request.environment == "bwrap" else request.environment
    if ":" in name:
        return EnvironmentConfig(import_path=name, kwargs=dict(request.environment_kwargs))
    return EnvironmentConfig(type=EnvironmentType(name), kwargs=dict(request.environment_kwargs))


def _agent_config(request: TrialRequest):
    from harbor.models.trial.config import AgentConfig

    from sandbox.harbor.agents import OFFLINE

    agent = OFFLINE.get(request.agent, request.agent)
    by_path = ":" in agent  # module:Class, or one of Harbor's agent names
    return AgentConfig(name=None if by_path else agent, import_path=agent if by_path else None,
                       model_name=request.model, env=dict(request.agent_env),
                       kwargs=dict(request.agent_kwargs))  # fmt: skip


def _phase_hooks(trial) -> None:
    """rolltap's bwrap environment learns from Harbor's own events when the verifier phase
    starts (its execs then run as the verifier's uid, in its own view) and when an agent phase
    starts again (a multi-step task's next step)."""
    from harbor.trial.hooks import TrialEvent

    from sandbox.harbor.environment import BwrapEnvironment

    environment = trial.agent_environment
    if not isinstance(environment, BwrapEnvironment):
        return

    async def verification(_event) -> None:
        await environment.begin_verification()

    async def agent(_event) -> None:
        await environment.end_verification()

    trial.add_hook(TrialEvent.VERIFICATION_START, verification)
    trial.add_hook(TrialEvent.AGENT_START, agent)


def _judged_by_its_work(trial) -> list[str]:
    """An agent that fails (exits non-zero, a reply it cannot parse, a context it overflowed)
    is the policy's doing: Harbor would leave the trial ungraded, an unscorable rollout that
    leaves its group's baseline, a way out of a bad reward that RL finds. Its failure is kept
    aside instead and the verifier runs on the workdir as the agent left it. Returns where the
    failure is noted."""
    failures: list[str] = []
    agent = trial.agent
    run = agent.run

    async def run_judged(*args, **kwargs):
        try:
            return await run(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 (noted, and the trial goes on to its verifier)
            failures.append(f"{type(exc).__name__}: {exc}"[:2000])

    agent.run = run_judged
    return failures


def _pool_hooks(trial, holder) -> None:
    """Moves the trial between the run's phase pools (sandbox/pools.py) as Harbor announces
    its phases: environment start and health check, agent install and run (one slot from
    AGENT_START, Harbor's install comes before it under the setup slot), verification."""
    from harbor.trial.hooks import TrialEvent

    def enter(phase):
        async def hook(_event) -> None:
            await holder.enter(phase)
        return hook

    async def leave(_event) -> None:
        holder.leave()

    trial.add_hook(TrialEvent.ENVIRONMENT_START, enter("setup"))
    trial.add_hook(TrialEvent.AGENT_START, enter("agent"))
    trial.add_hook(TrialEvent.AGENT_END, leave)
    trial.add_hook(TrialEvent.VERIFICATION_START, enter("verify"))
    trial.add_hook(TrialEvent.END, leave)
    trial.add_hook(TrialEvent.CANCEL, leave)


_pools = None  # the run's phase pools, from its first request


def _holder(request: TrialRequest):
    global _pools
    from sandbox.pools import Holder, PhasePools

    if _pools is None:
        limits = request.pool_limits
        _pools = PhasePools(limits.get("setup"), limits.get("agent"), limits.get("verify"))
    return Holder(_pools)


def _seconds(timing) -> float | None:
    if timing is None or timing.started_at is None or timing.finished_at is None:
        return None
    return round((timing.finished_at - timing.started_at).total_seconds(), 3)


async def run_trial(request: TrialRequest) -> TrialReply:
    from harbor.models.trial.config import TaskConfig, TrialConfig
    from harbor.trial.trial import Trial

    from sandbox.harbor.environment import BwrapEnvironment

    try:
        config = TrialConfig(
            task=TaskConfig(path=Path(request.task_dir)),
            trial_name=request.trial_name,
            trials_dir=Path(request.trials_dir),
            agent=_agent_config(request),
            environment=_environment_config(request),
        )
        trial = await Trial.create(config)
        _phase_hooks(trial)
        agent_failures = _judged_by_its_work(trial)
        holder = _holder(request)
        _pool_hooks(trial, holder)
        try:
            result = await trial.run()
        finally:
            holder.leave()
    except Exception as exc:  # the trial never ran: the caller reports it as this rollout's
        return TrialReply(id=request.id, rewards=None, reward_valid=False,
                          error=f"{type(exc).__name__}: {exc}")
    info = result.exception_info
    cause = result.failure_cause
    phases = {name: s for name in ("environment_setup", "agent_setup", "agent_execution",
                                   "verifier")
              if (s := _seconds(getattr(result, name))) is not None}
    if (whole := _seconds(result)) is not None:
        phases["trial"] = whole
    rewards = result.verifier_result.rewards if result.verifier_result else None
    environment = trial.agent_environment
    return TrialReply(
        id=request.id,
        rewards={k: float(v) for k, v in rewards.items()} if rewards else None,
        reward_valid=result.reward_valid,
        exception=(f"{info.exception_type}: {info.exception_message}" if info else None),
        failure_cause=getattr(cause, "value", cause) if cause is not None else None,
        phases=phases,
        trial_dir=str(os.path.join(request.trials_dir, request.trial_name)),
        seal=environment.seal_report if isinstance(environment, BwrapEnvironment) else None,
        agent_error=agent_failures[0] if agent_failures else None,
        queue_wait_s={k: round(v, 3) for k, v in holder.waited_s.items()},
    )


async def serve(out_fd: int) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 24)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    running: dict[int, asyncio.Task] = {}

    async def one(request: TrialRequest) -> None:
        try:
            reply = await run_trial(request)
        except asyncio.CancelledError:
            reply = TrialReply(id=request.id, rewards=None, reward_valid=False,
                               error="cancelled")
        finally:
            running.pop(request.id, None)
        os.write(out_fd, encode(reply))

    while line := await reader.readline():
        message = decoder.decode(line)
        if isinstance(message, TrialRequest):
            running[message.id] = asyncio.ensure_future(one(message))
        elif isinstance(message, Cancel) and message.id in running:
            running[message.id].cancel()
    await asyncio.gather(*running.values(), return_exceptions=True)


def main() -> None:
    out_fd = os.dup(1)
    os.dup2(2, 1)  # Harbor, litellm and agents print: keep them off the protocol
    started = time.monotonic()
    import harbor
    from harbor.trial.trial import Trial  # noqa: F401  (the costly import, done before Ready)

    os.write(out_fd, encode(Ready(harbor_version=getattr(harbor, "__version__", "?"),
                                  import_s=round(time.monotonic() - started, 3))))
    asyncio.run(serve(out_fd))


if __name__ == "__main__":
    main()
