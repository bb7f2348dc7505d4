"""Run one rollout's sandbox on this machine.

Order inside one sandbox, each step a contained process (own session, rlimits, pids cgroup,
wall-clock timeout, bounded output, no process left afterwards):
  1. fresh directories, the task's starting files in the workdir;
  2. the task's setup command, if any;
  3. the harness, with the rollout's key and gateway URLs and nothing else of the runner's
     environment, in a private mount namespace (isolation.py) where the task set's files,
     every other sandbox, the runner's state file and the raw disks are hidden;
  4. only after every process of the harness is gone: the hidden tests into the workdir, and
     the verifier, with a fresh HOME and without the rollout's key;
  5. the directories are removed.
"""

from __future__ import annotations

import os
import socket

from sandbox.backends.base import (
    SandboxRequest,
    SandboxResult,
    SandboxStatus,
    decide_reward,
    needs_verifier,
)
from sandbox.isolation import IsolationStatus, MountOp, sandbox_mounts, unavailable_reason
from sandbox.layout import (
    SandboxDirs,
    base_env,
    make_dirs,
    remove_dirs,
    sandbox_parent,
    sandbox_path,
    verifier_dirs,
    write_files,
)
from sandbox.limits import Limits
from sandbox.presets import LaunchContext, build_launch, harness_limits
from sandbox.process import run_contained
from sandbox.verifier import verify


class LocalBackend:
    def __init__(
        self,
        *,
        root: str | None = None,
        task_limits: Limits | None = None,
        use_cgroup: bool = True,
        keep_dirs: bool = False,
        mount_isolation: bool = True,
    ) -> None:
        """`root`: where sandbox directories are made (default: a directory of this user's in
        the system temp dir); the agent sees none of it but its own sandbox. `task_limits`:
        limits of the setup and verifier commands. `use_cgroup`: give every process tree its
        own pids cgroup when the machine allows it. `keep_dirs`: leave the sandbox directories
        for inspection. `mount_isolation`: run the agent in a private mount namespace that
        hides the task set's files, the other sandboxes and the runner's private paths (where
        the machine refuses it, the agent runs without, with a warning in the result)."""
        self.root = root
        self.task_limits = task_limits or Limits()
        self.use_cgroup = use_cgroup
        self.keep_dirs = keep_dirs
        self.mount_isolation = mount_isolation

    def _isolation(self) -> tuple[IsolationStatus, tuple[str, ...]]:
        if not self.mount_isolation:
            return "disabled", ()
        if reason := unavailable_reason():
            return "unavailable", (
                f"mount isolation unavailable ({reason}): the agent ran without it and could "
                "read the task set's hidden tests and other sandboxes",
            )
        return "mounts", ()

    @staticmethod
    def _mounts(request: SandboxRequest, dirs: SandboxDirs) -> tuple[MountOp, ...]:
        hide = [*request.task.source_paths, *request.private_paths, os.path.dirname(dirs.root)]
        return sandbox_mounts(hide, keep=dirs.root)

    async def run(self, request: SandboxRequest) -> SandboxResult:
        task, harness, access = request.task, request.harness, request.access
        host = socket.gethostname()
        isolation, warnings = self._isolation()
        dirs = make_dirs(sandbox_parent(self.root), task.id)
        try:
            write_files(dirs.work, task.files)
            env = base_env(dirs, sandbox_path())
            setup = None
            if task.setup:
                setup = await run_contained(
                    ["/bin/sh", "-c", task.setup],
                    cwd=dirs.work,
                    env=env,
                    limits=self.task_limits,
                    timeout_s=task.timeouts.setup_s,
                    use_cgroup=self.use_cgroup,
                )
                if setup.status != "ok":
                    reward, detail = decide_reward("setup_failed", request.crash_reward, None)
                    return SandboxResult("setup_failed", reward, detail, host, setup=setup,
                                         isolation=isolation, warnings=warnings)
            launch = build_launch(
                harness,
                LaunchContext(
                    prompt=task.prompt,
                    api_key=access.api_key,
                    openai_base_url=access.openai_base_url,
                    anthropic_base_url=access.anthropic_base_url,
                    workdir=dirs.work,
                    home=dirs.home,
                ),
            )
            write_files(dirs.home, launch.files)
            agent = await run_contained(
                launch.argv,
                cwd=dirs.work,
                env=env | launch.env,
                limits=harness_limits(harness),
                timeout_s=task.timeouts.agent_s,
                use_cgroup=self.use_cgroup,
                mounts=self._mounts(request, dirs) if isolation == "mounts" else None,
            )
            status: SandboxStatus = agent.status
            verifier = None
            if needs_verifier(status, request.crash_reward):
                vdirs = verifier_dirs(dirs)
                verifier = await verify(
                    task.verifier,
                    vdirs,
                    base_env(vdirs, sandbox_path()),
                    self.task_limits,
                    task.timeouts.verifier_s,
                    self.use_cgroup,
                )
            reward, detail = decide_reward(status, request.crash_reward, verifier)
            return SandboxResult(status, reward, detail, host, agent, setup, verifier,
                                 isolation, warnings)
        finally:
            if not self.keep_dirs:
                remove_dirs(dirs)
