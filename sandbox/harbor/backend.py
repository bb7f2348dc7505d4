"""Harbor as a rolltap sandbox backend: one Harbor trial per rollout, run by the worker.

The runner (runner.py) keeps what RL needs: the rollout at the gateway, groups, backpressure,
resume, the reward post. This backend hands each rollout to the Harbor worker (worker.py, in
Harbor's own venv) as one trial whose agent holds the rollout's key and base URLs as its only
credential, and turns the trial's result into a SandboxResult:
- a valid reward: the `reward_key` entry of Harbor's rewards is the reward, the other entries go
  to the rollout's metrics;
- `reward_valid` false (the environment did not start or become healthy, the verifier left no
  reward, ...): an infrastructure failure, not a wrong answer: status `setup_failed`, reward
  None (unscorable), Harbor's failure cause and exception in the metrics and the detail;
- an agent that failed (exited non-zero, a reply it could not use: the model's doing) is judged
  by its work: the worker lets the verifier run on the workdir as left (worker.py), and where
  that gives no reward the rollout scores 0, never None.

On the bwrap environment the verifier's pytest runs are sealed (seal.py): before a task's first
rollout, one collection trial (the oracle where the task has a solution, else nop with the
workdir's modules stubbed) learns its expected tests; each trial's reward then stands only as
far as the sealed report bears it out, else it is 0 and the rollout `tampered`. A task whose
verifier runs no sealed pytest is said to be unsealed in each rollout's detail.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import re
import tempfile
from typing import Any

import msgspec

from sandbox.backends.base import SandboxRequest, SandboxResult, SandboxStatus
from sandbox.harbor.protocol import (
    Cancel,
    Ready,
    SealReport,
    TrialReply,
    TrialRequest,
    decoder,
    encode,
)
from sandbox.harbor.seal import sealed_reward
from sandbox.pools import PhasePools
from sandbox.relay import inside_url

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HARBOR_VENV = ".venv-harbor"
HARBOR_MISSING = (
    "Harbor's venv is missing ({python}): run `make install`, which makes it (Harbor needs "
    "Python >= 3.12), or point ROLLTAP_HARBOR_PYTHON at a Python that has harbor==0.25.0 "
    "and msgspec"
)
WORKER_START_S = 120.0


class TrialOutcome(msgspec.Struct, frozen=True):
    status: SandboxStatus
    reward: float | None
    detail: str
    metrics: dict[str, Any]


def trial_outcome(reply: TrialReply, reward_key: str = "reward",
                  collected: SealReport | None = None) -> TrialOutcome:
    """What one trial's result means for its rollout, `collected` the task's sealed
    collection (None: the task is unsealed). Pure."""
    metrics: dict[str, Any] = {"harbor_phases_s": dict(reply.phases)}
    if reply.trial_dir:
        metrics["harbor_trial_dir"] = reply.trial_dir
    if reply.exception:
        metrics["harbor_exception"] = reply.exception
    if reply.failure_cause:
        metrics["harbor_failure_cause"] = reply.failure_cause
    if reply.error is not None:
        metrics["harbor_error"] = reply.error
        return TrialOutcome("setup_failed", None, f"unscorable: harbor: {reply.error}", metrics)
    rewards = reply.rewards or {}
    if not reply.reward_valid and reply.agent_error:
        metrics["harbor_agent_error"] = reply.agent_error
        return TrialOutcome("ok", 0.0, "the agent failed and its work could not be verified: "
                            f"0 ({reply.agent_error.splitlines()[0]})", metrics)
    if not reply.reward_valid:
        cause = reply.failure_cause or "no reward"
        why = f"{cause}: {reply.exception}" if reply.exception else cause
        return TrialOutcome("setup_failed", None, f"unscorable: {why}", metrics)
    if reward_key not in rewards:
        metrics["harbor_rewards"] = rewards
        return TrialOutcome(
            "setup_failed", None,
            f"unscorable: the verifier's rewards have no {reward_key!r} (keys: "
            f"{', '.join(sorted(rewards))}); choose one with --reward-key", metrics)
    others = {k: v for k, v in rewards.items() if k != reward_key}
    if others:
        metrics["harbor_rewards"] = others
    detail = f"harbor {reward_key}={rewards[reward_key]:g}"
    if reply.exception:  # graded as Harbor grades it, e.g. an agent that ran out of time
        detail += f" ({reply.exception.splitlines()[0]})"
    if reply.agent_error:  # the model's doing: judged by the work it left, never unscorable
        metrics["harbor_agent_error"] = reply.agent_error
        detail += f" (the agent failed, judged by its work: {reply.agent_error.splitlines()[0]})"
    reward, tampered, verdict = sealed_reward(rewards[reward_key], reply.seal,
                                              is_sealed(collected))
    if collected is not None and collected.problem is not None:
        verdict += f" (collecting its tests: {collected.problem})"
    metrics["harbor_seal"] = verdict
    return TrialOutcome("tampered" if tampered else "ok", reward, f"{detail}; {verdict}",
                        metrics)


def is_sealed(collected: SealReport | None) -> bool:
    return collected is not None and collected.problem is None and collected.runs > 0


def mentions_pytest(tests_dir: str) -> bool:
    """Whether any file of a task's tests/ names pytest: only then can its verifier run a
    sealed pytest, and a collection trial is worth running."""
    for dirpath, _, filenames in os.walk(tests_dir):
        for name in filenames:
            try:
                with open(os.path.join(dirpath, name), "rb") as fh:
                    if re.search(rb"pytest|py\.test", fh.read(1 << 20)):
                        return True
            except OSError:
                continue
    return False


def harbor_python() -> str:
    return os.environ.get("ROLLTAP_HARBOR_PYTHON") or os.path.join(
        REPO, HARBOR_VENV, "bin", "python")


def agent_env(base_openai: str, base_anthropic: str, api_key: str) -> dict[str, str]:
    """The agent's only credential and where to use it, under the names Harbor's agents read
    (claude-code: ANTHROPIC_*; codex, qwen-coder, mini-swe-agent: OPENAI_*). Pure."""
    return {"OPENAI_BASE_URL": base_openai, "OPENAI_API_KEY": api_key,
            "ANTHROPIC_BASE_URL": base_anthropic, "ANTHROPIC_API_KEY": api_key}


class HarborBackend:
    """Runs each rollout as one Harbor trial of `agent` in `environment` ("bwrap": rolltap's
    sandbox; else any Harbor environment type or module:Class, reaching the gateway at
    `public_url`)."""

    def __init__(self, agent: str, *, model: str | None, gateway: str,
                 public_url: str | None = None, environment: str = "bwrap",
                 environment_kwargs: dict[str, Any] | None = None,
                 agent_kwargs: dict[str, Any] | None = None,
                 extra_env: dict[str, str] | None = None, reward_key: str = "reward",
                 trials_dir: str | None = None, pools: PhasePools | None = None) -> None:
        self.agent, self.model, self.gateway = agent, model, gateway
        self.public_url = public_url or gateway
        self.environment = environment
        self.environment_kwargs = dict(environment_kwargs or {})
        if environment == "bwrap":
            self.environment_kwargs.setdefault("gateway_url", gateway)
        self.agent_kwargs = dict(agent_kwargs or {})
        self.extra_env = dict(extra_env or {})
        self.reward_key = reward_key
        self.trials_dir = trials_dir or tempfile.mkdtemp(prefix="rolltap-harbor-trials-")
        # The limits go to the worker, which holds the slots; the waits it reports land here.
        self.pools = pools or PhasePools()
        self.python = harbor_python()
        self.ready: Ready | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[TrialReply]] = {}
        self._worker: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task | None = None
        self._starting = asyncio.Lock()
        # A task's collection trial, run once (bwrap only: no other environment seals).
        self.seal = environment == "bwrap"
        self._collected: dict[str, asyncio.Future[SealReport | None]] = {}

    def check(self) -> None:
        """Raises ValueError, with what to do, when the worker cannot start."""
        if not os.access(self.python, os.X_OK):
            raise ValueError(HARBOR_MISSING.format(python=self.python))

    async def start(self) -> asyncio.subprocess.Process:
        async with self._starting:
            if self._worker is not None:
                return self._worker
            self.check()
            # Nothing of the runner's environment (the admin key) reaches Harbor or its agents.
            # Harbor's podman environment runs podman-compose from Harbor's venv by name, and
            # podman reads its settings (containers.conf) from CONTAINERS_CONF.
            path = os.pathsep.join([os.path.dirname(self.python),
                                    os.environ.get("PATH", "/usr/bin:/bin")])
            env = {"PATH": path, "HOME": os.path.expanduser("~"), "PYTHONPATH": REPO,
                   "HARBOR_TELEMETRY": "0", "LITELLM_LOCAL_MODEL_COST_MAP": "True",
                   "LANG": "C.UTF-8", **{k: os.environ[k] for k in ("CONTAINERS_CONF",)
                                          if k in os.environ}}
            worker = await asyncio.create_subprocess_exec(
                self.python, "-m", "sandbox.harbor.worker", stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, env=env, limit=1 << 24)
            assert worker.stdout is not None
            line = await asyncio.wait_for(worker.stdout.readline(), WORKER_START_S)
            if not line:
                raise RuntimeError(f"the Harbor worker exited at start ({self.python}); its "
                                   "stderr above says why")
            ready = decoder.decode(line)
            assert isinstance(ready, Ready), ready
            self.ready, self._worker = ready, worker
            self._reader = asyncio.ensure_future(self._read(worker))
            return worker

    async def _read(self, worker: asyncio.subprocess.Process) -> None:
        assert worker.stdout is not None
        while line := await worker.stdout.readline():
            reply = decoder.decode(line)
            if isinstance(reply, TrialReply) and (f := self._pending.pop(reply.id, None)):
                if not f.done():
                    f.set_result(reply)
        for f in self._pending.values():
            if not f.done():
                f.set_exception(RuntimeError("the Harbor worker exited"))
        self._pending.clear()

    def _send(self, worker: asyncio.subprocess.Process, message) -> None:
        assert worker.stdin is not None
        worker.stdin.write(encode(message))

    def _env(self, request: SandboxRequest) -> dict[str, str]:
        access = request.access
        if self.environment == "bwrap":
            own = agent_env(inside_url(access.openai_base_url),
                            inside_url(access.anthropic_base_url), access.api_key)
        else:
            public = self.public_url.rstrip("/")
            own = agent_env(public + "/v1", public, access.api_key)
        return {**self.extra_env, **own}

    async def _trial(self, trial: TrialRequest) -> TrialReply:
        worker = await self.start()
        reply_future: asyncio.Future[TrialReply] = asyncio.get_running_loop().create_future()
        self._pending[trial.id] = reply_future
        self._send(worker, trial)
        try:
            return await asyncio.shield(reply_future)
        except asyncio.CancelledError:
            self._send(worker, Cancel(trial.id))  # Harbor stops the trial's environment
            with contextlib.suppress(Exception):
                await asyncio.wait_for(reply_future, 30)
            raise

    async def collected(self, task_dir: str, task_id: str) -> SealReport | None:
        """The task's expected tests, from one collection trial on its own files (the oracle's
        solution where it has one); None where nothing is sealed."""
        if not self.seal:
            return None
        if task_dir not in self._collected:
            self._collected[task_dir] = asyncio.ensure_future(self._collect(task_dir, task_id))
        return await asyncio.shield(self._collected[task_dir])

    async def _collect(self, task_dir: str, task_id: str) -> SealReport | None:
        if not mentions_pytest(os.path.join(task_dir, "tests")):
            return None  # nothing to seal: no collection trial
        oracle = os.path.isfile(os.path.join(task_dir, "solution", "solve.sh"))
        reply = await self._trial(TrialRequest(
            id=next(self._ids), task_dir=task_dir, trial_name=f"{task_id}__collect",
            trials_dir=os.path.join(self.trials_dir, "collect"),
            agent="oracle" if oracle else "nop", model=None, agent_env={},
            environment=self.environment,
            environment_kwargs={**self.environment_kwargs, "seal": "collect",
                                "seal_stub": not oracle},
            pool_limits=self.pools.limits()))
        return reply.seal

    async def run(self, request: SandboxRequest) -> SandboxResult:
        task_dir = request.task.source_paths[0]
        collected = await self.collected(task_dir, request.task.id)
        seal = ({"seal": "judge", "seal_expected": collected.expected}
                if collected is not None and is_sealed(collected) else {})
        trial = TrialRequest(
            id=next(self._ids), task_dir=task_dir,
            trial_name=f"{request.task.id}__{request.access.rollout_id[:12]}",
            trials_dir=self.trials_dir, agent=self.agent, model=self.model,
            agent_env=self._env(request), agent_kwargs=self.agent_kwargs,
            environment=self.environment,
            environment_kwargs={**self.environment_kwargs, **seal},
            pool_limits=self.pools.limits())
        reply = await self._trial(trial)
        for phase, waited in reply.queue_wait_s.items():
            self.pools.note(phase, waited)
        outcome = trial_outcome(reply, self.reward_key, collected)
        return SandboxResult(
            status=outcome.status, reward=outcome.reward, reward_detail=outcome.detail,
            host=os.uname().nodename,
            isolation="bwrap" if self.environment == "bwrap" else "harbor",
            extra_metrics=outcome.metrics, agent_failed=reply.agent_error is not None)

    async def aclose(self) -> None:
        if self._worker is None:
            return
        assert self._worker.stdin is not None
        self._worker.stdin.close()  # EOF: the worker ends after its trials
        try:
            await asyncio.wait_for(self._worker.wait(), 30)
        except TimeoutError:
            self._worker.kill()
            await self._worker.wait()
        if self._reader is not None:
            await self._reader
