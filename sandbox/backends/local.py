"""Run one rollout's sandbox on this machine.

Order inside one sandbox (layout.py has the directories, confine.py the confinement):
  1. the agent's area (a bounded tmpfs owned by the agent's uid) with the task's files;
  2. the task's setup command, if any, confined as the agent's uid, without network;
  3. the harness, confined as the agent's uid, with the rollout's key and the gateway's URLs
     and nothing else of the runner's environment; its network namespace reaches only the
     gateway, through a Unix socket (relay.py);
  4. once the agent's PID namespace is gone (with every process in it): the protected paths
     checked (a change scores 0, `tampered`); the agent's workdir copied into the verifier's
     area (another uid's); the verifier confined there without network, the hidden tests and
     the protected originals bound read-only; its report read from a pipe (verifier.py);
  5. the areas unmounted and the directories removed.

A task with an image (`image` or `dockerfile_dir`) has it found, pulled or built and unpacked
first (images.py; a failure leaves the rollout unscorable, reward None), held for the whole
sandbox; every phase then sees it as `/` under an overlay of its own area (confine.py), runs the
image's PATH, and gets rolltap's programs (the harness, the gateway forwarder) run with the
host's loader (hostexec.py).

Each phase also runs with rlimits and in a cgroup of its own, with a wall-clock timeout and
bounded output (process.py). `isolation="none"` runs the same steps unconfined: the explicit
opt-out, recorded in every result.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
import socket
import sys
from collections.abc import Mapping, Sequence
from pathlib import PurePosixPath
from urllib.parse import urlsplit

import msgspec

from sandbox import confine, hostexec, images
from sandbox.backends.base import (
    Isolation,
    SandboxRequest,
    SandboxResult,
    SandboxStatus,
    decide_reward,
    needs_verifier,
)
from sandbox.confine import Bind, Image, Phase, View
from sandbox.layout import (
    INSIDE_DIRS,
    CopyOverflow,
    SandboxDirs,
    base_env,
    chown_tree,
    copy_work,
    make_area,
    make_root,
    release_areas,
    remove_tree,
    replace_files,
    runtime_paths,
    sandbox_parent,
    sandbox_path,
    write_files,
    write_identity,
)
from sandbox.limits import Limits
from sandbox.pools import PhasePools
from sandbox.presets import LaunchContext, build_launch, harness_limits, install_paths
from sandbox.process import ProcessOutcome, run_contained
from sandbox.relay import Relay, forwarded, inside_port, inside_url
from sandbox.tamper import changed
from sandbox.tasks import Task, protected_files
from sandbox.verifier import (
    Run,
    TaskTestsError,
    VerifierResult,
    collect,
    make_sentinels,
    verify,
)

# PATH inside an image (the usual one of Debian and of Docker's images).
IMAGE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# An image's overlay in each area (its size bound is the area's); its files keep the image's
# owners.
OVERLAY = ".overlay"
# Host tools of the gateway forwarder (relay.py), brought into an image.
FORWARDER_TOOLS = ("socat", "grep", "sleep")

# Room in the verifier's area beyond the agent's whole disk (its copy) for what tests write.
VERIFIER_DISK_MARGIN_MB = 256


class _Sandbox:
    """One sandbox's directories, uids and view; run() drives its phases."""

    def __init__(self, backend: LocalBackend, request: SandboxRequest, root: str,
                 parent: str) -> None:
        self.backend, self.request, self.root = backend, request, root
        self.confined = backend.isolation == "bwrap"
        own = self.confined and confine.own_uids()
        self.agent_uid = confine.new_uid() if own else os.geteuid()
        self.verifier_uid = self.agent_uid
        while own and self.verifier_uid == self.agent_uid:
            self.verifier_uid = confine.new_uid()
        self.own_uids = own
        task = request.task
        self.hidden = confine.hidden_kinds([*task.source_paths, *request.private_paths, parent])
        self.path = sandbox_path()
        self.rootfs: str | None = None  # the task image's root filesystem, once held
        self.warnings: list[str] = []
        if self.confined and not own:
            self.warnings.append("not root: every phase ran as the runner's own uid (separate "
                                 "namespaces, shared file ownership)")

    def read_only(self, extra: Sequence[str]) -> list[Bind]:
        binds = confine.ro_binds([*runtime_paths(), *extra, *self.backend.read_only_paths])
        secret = [*self.request.task.source_paths, *self.request.private_paths]
        if clash := confine.exposed(binds, [os.path.realpath(p) for p in secret]):
            source, hidden = clash[0]
            raise ValueError(f"{source} would be visible to the agent, but it lies inside "
                             f"{hidden}, which holds hidden tests or runner state")
        return binds

    def area(self, name: str, size_mb: int | None) -> SandboxDirs:
        dirs, problem = make_area(self.root, name, size_mb)
        if problem and size_mb is not None:
            self.warnings.append(f"{name}: {problem}")
        return dirs

    async def phase(self, argv: list[str], dirs: SandboxDirs, uid: int, env: Mapping[str, str],
                    limits: Limits, timeout_s: float, binds: Sequence[Bind], *,
                    gateway_socket: str | None = None,
                    pass_fds: Sequence[int] = ()) -> ProcessOutcome:
        common = {"env": env, "limits": limits, "timeout_s": timeout_s,
                  "use_cgroup": self.backend.use_cgroup, "pass_fds": pass_fds}
        if not self.confined:
            return await run_contained(argv, cwd=dirs.work, **common)
        passwd, group = write_identity(self.root, uid)
        image = None
        if self.rootfs is not None:
            image = Image(self.rootfs, os.path.join(dirs.root, OVERLAY))
            os.makedirs(image.overlay, mode=0o700, exist_ok=True)
        view = View(
            binds=(Bind(dirs.work, INSIDE_DIRS.work, True), Bind(dirs.home, INSIDE_DIRS.home, True),
                   Bind(dirs.tmp, INSIDE_DIRS.tmp, True), Bind(passwd, "/etc/passwd"),
                   Bind(group, "/etc/group"), *binds),
            hidden=self.hidden,
            gateway_socket=gateway_socket,
            image=image,
        )
        phase = Phase(view, uid, INSIDE_DIRS.work, tuple(argv))
        return await run_contained(confine.command(phase), cwd=dirs.root, confined=True,
                                   own_uid=self.own_uids, **common)

    def give(self, dirs: SandboxDirs, uid: int) -> None:
        if self.own_uids:
            chown_tree(dirs.root, uid, skip=OVERLAY)

    async def hold_image(self, stack: contextlib.ExitStack) -> str | None:
        """The task image's root filesystem (if the task has one), held until `stack` closes;
        why not, if it cannot be had."""
        task = self.request.task
        if task.image is None and task.build is None:
            return None
        if not self.confined:
            return "task images need --isolation bwrap (an image is the sandbox's root)"
        if not self.own_uids:
            return confine.NO_IMAGE_WITHOUT_ROOT
        try:
            self.rootfs = await asyncio.to_thread(stack.enter_context, images.rootfs_for(
                task.image, task.build, self.backend.image_cache))
        except images.ImageError as exc:
            return str(exc)
        return None

    def env(self, dirs: SandboxDirs) -> dict[str, str]:
        if self.rootfs is None:
            return base_env(INSIDE_DIRS if self.confined else dirs, self.path)
        # The image's PATH and python; rolltap's pytest plugin importable by that python.
        package = os.path.dirname(os.path.dirname(os.path.abspath(confine.__file__)))
        return base_env(INSIDE_DIRS, IMAGE_PATH) | {"PYTHONPATH": package}

    @property
    def python(self) -> str:
        """The interpreter that runs the pytest launcher: rolltap's own on the host; inside an
        image the image's, whose packages the task's tests need (the launcher is bound in at
        its host path, and `-I` keeps the work directory off its import path)."""
        return sys.executable if self.rootfs is None else "python3"

    def host_argv(self, argv: list[str]) -> list[str]:
        """The harness's command line; inside an image, run with the host's loader."""
        if self.rootfs is None:
            return argv
        return hostexec.wrap(argv, lambda name: shutil.which(name, path=self.path))

    def confined_argv(self, argv: list[str]) -> tuple[list[str], list[str], str]:
        """The harness's argv as the host runs it, and the shell (with its prelude) that
        forwards the gateway inside; raises hostexec.HostProgramError."""
        if self.rootfs is None:
            return self.host_argv(argv), ["/bin/sh"], ""
        return (self.host_argv(argv), self.host_argv(["/bin/sh"]),
                hostexec.host_shell_prelude(FORWARDER_TOOLS))

    async def run(self, stack: contextlib.ExitStack) -> SandboxResult:
        request, backend = self.request, self.backend
        task, harness, access = request.task, request.harness, request.access
        isolation: Isolation = "bwrap" if self.confined else "none"
        agent_limits = harness_limits(harness)
        inside = INSIDE_DIRS if self.confined else None
        dirs = self.area("agent", agent_limits.disk_mb)
        async with backend.pools.slot("setup"):
            setup, failed = await self.set_up(stack, dirs)
        if failed is not None:
            return failed
        env = self.env(dirs)
        openai_url, anthropic_url = access.openai_base_url, access.anthropic_base_url
        if self.confined:
            openai_url, anthropic_url = inside_url(openai_url), inside_url(anthropic_url)
        launch = build_launch(harness, LaunchContext(
            prompt=task.prompt, api_key=access.api_key, openai_base_url=openai_url,
            anthropic_base_url=anthropic_url, workdir=(inside or dirs).work,
            home=(inside or dirs).home))
        write_files(dirs.home, launch.files)
        self.give(dirs, self.agent_uid)
        argv, relay, gateway_socket = launch.argv, None, None
        if self.confined:
            try:
                argv, shell, prelude = self.confined_argv(launch.argv)
            except hostexec.HostProgramError as exc:
                return self.result("setup_failed", None, f"harness: {exc}", setup=setup)
            gateway_socket = backend.gateway_socket
            if gateway_socket is None:
                relay = await Relay.start(access.openai_base_url)
                gateway_socket = relay.path
            argv = forwarded(argv, inside_port(access.openai_base_url), shell, prelude)
        try:
            async with backend.pools.slot("agent"):
                agent = await self.phase(argv, dirs, self.agent_uid, env | launch.env,
                                         agent_limits, task.timeouts.agent_s,
                                         self.read_only(install_paths(harness, self.path)),
                                         gateway_socket=gateway_socket)
        finally:
            if relay is not None:
                await relay.close()
        status: SandboxStatus = agent.status
        if touched := changed(task.protected, task.files, dirs.work):
            return self.result("tampered", 0.0,
                               f"agent changed protected paths: {', '.join(touched)}",
                               agent=agent, setup=setup)
        verifier = None
        if needs_verifier(status, request.crash_reward):
            async with backend.pools.slot("verify"):
                verifier = await self.verify(task, dirs)
            if verifier.tampered:
                status = "tampered"
        reward, detail = decide_reward(status, request.crash_reward, verifier)
        return self.result(status, reward, detail, agent=agent, setup=setup, verifier=verifier,
                           isolation=isolation)

    async def set_up(self, stack: contextlib.ExitStack, dirs: SandboxDirs
                     ) -> tuple[ProcessOutcome | None, SandboxResult | None]:
        """The setup phase: the task's image held, its files written, its setup command run.
        Returns the setup command's outcome, and the sandbox's result if setup failed."""
        task = self.request.task
        if problem := await self.hold_image(stack):
            return None, self.result("setup_failed", None, f"task image: {problem}")
        write_files(dirs.work, task.files)
        if not task.setup:
            return None, None
        self.give(dirs, self.agent_uid)
        setup = await self.phase(["/bin/sh", "-c", task.setup], dirs, self.agent_uid,
                                 self.env(dirs), self.backend.task_limits,
                                 task.timeouts.setup_s, self.read_only([]))
        if setup.status != "ok":
            reward, detail = decide_reward("setup_failed", self.request.crash_reward, None)
            return setup, self.result("setup_failed", reward, detail, setup=setup)
        return setup, None

    async def verify(self, task: Task, agent_dirs: SandboxDirs) -> VerifierResult:
        """The verifier over a copy of the agent's workdir, in its own area and uid; for a
        `pytest` reward, after collecting the expected tests on the task's own files."""
        kind, command = task.verifier.reward, task.verifier.command
        expected = sentinels = None
        if kind == "pytest":
            try:
                expected = await self.expected_tests(task)
            except TaskTestsError as exc:
                return VerifierResult(None, str(exc), "ok", None, 0.0)
            sentinels = make_sentinels()
        limits = self.backend.task_limits
        size = None if limits.disk_mb is None else limits.disk_mb + VERIFIER_DISK_MARGIN_MB
        dirs = self.area("verifier", size)
        originals = protected_files(task)
        ours = dict(task.verifier.files)
        if sentinels is not None:
            ours[sentinels.path] = sentinels.source
        budget = None if limits.disk_mb is None else limits.disk_mb << 20
        binds: list[Bind] = []
        try:
            if self.confined:
                hidden = os.path.join(self.root, "hidden")
                kept = os.path.join(self.root, "protected")
                write_files(hidden, ours)
                write_files(kept, originals)
                tops = sorted({PurePosixPath(n).parts[0] for n in ours})
                binds = [Bind(os.path.join(hidden, t), f"{INSIDE_DIRS.work}/{t}") for t in tops]
                binds += [Bind(os.path.join(kept, p), f"{INSIDE_DIRS.work}/{p}")
                          for p in task.protected if os.path.lexists(os.path.join(kept, p))]
                copy_work(agent_dirs.work, dirs.work, {*tops, *task.protected}, budget)
            else:
                copy_work(agent_dirs.work, dirs.work, set(task.protected), budget)
                replace_files(dirs.work, ours)
                write_files(dirs.work, originals)
        except CopyOverflow as exc:
            return VerifierResult(0.0, f"the agent's workdir does not fit the verifier's: {exc}",
                                  "ok", None, 0.0)
        self.give(dirs, self.verifier_uid)
        run = self.runner(dirs, task.timeouts.verifier_s, binds)
        return await verify(kind, command, run, self.python, expected, sentinels)

    def runner(self, dirs: SandboxDirs, timeout_s: float, binds: Sequence[Bind]) -> Run:
        """Runs a verifier process in `dirs` as the verifier's uid, without network."""
        env = self.env(dirs)
        read_only = [*self.read_only([]), *binds]

        async def run(argv: Sequence[str], extra: Mapping[str, str],
                      fds: Sequence[int]) -> ProcessOutcome:
            return await self.phase(list(argv), dirs, self.verifier_uid, env | dict(extra),
                                    self.backend.task_limits, timeout_s, read_only,
                                    pass_fds=fds)

        return run

    async def expected_tests(self, task: Task) -> frozenset[str]:
        """The task's tests as collected on its own files (starting files, hidden tests),
        once per task and backend. Raises TaskTestsError."""
        digest = hashlib.sha256(msgspec.msgpack.encode(
            (task.files, task.verifier.files, task.verifier.command))).hexdigest()
        if (known := self.backend.expected.get(digest)) is not None:
            return known
        dirs = self.area("collect", self.backend.task_limits.disk_mb)
        write_files(dirs.work, task.files)
        replace_files(dirs.work, task.verifier.files)
        self.give(dirs, self.verifier_uid)
        run = self.runner(dirs, task.timeouts.verifier_s, [])
        keep = [*task.verifier.files, *protected_files(task)]
        tests = await collect(run, task.verifier.command, self.python, keep)
        self.backend.expected[digest] = tests
        return tests

    def result(self, status: SandboxStatus, reward: float | None, detail: str, *,
               agent: ProcessOutcome | None = None, setup: ProcessOutcome | None = None,
               verifier: VerifierResult | None = None,
               isolation: Isolation | None = None) -> SandboxResult:
        return SandboxResult(status, reward, detail, socket.gethostname(), agent, setup,
                             verifier, isolation or ("bwrap" if self.confined else "none"),
                             tuple(self.warnings))


class LocalBackend:
    def __init__(
        self,
        *,
        root: str | None = None,
        task_limits: Limits | None = None,
        use_cgroup: bool = True,
        keep_dirs: bool = False,
        isolation: Isolation = "bwrap",
        gateway_socket: str | None = None,
        read_only_paths: Sequence[str] = (),
        image_cache: images.Cache | None = None,
        pools: PhasePools | None = None,
    ) -> None:
        """`root`: where sandbox directories are made (default: a directory of this user's in
        the system temp dir); no phase sees any of it but its own area. `task_limits`: limits
        of the setup and verifier commands. `use_cgroup`: give every phase a cgroup of its own
        where the machine allows it. `keep_dirs`: leave the sandbox directories for inspection.
        `isolation`: "bwrap" confines every phase (confine.py; raises ConfinementError naming
        the package where bubblewrap is missing), "none" runs them unconfined.
        `gateway_socket`: the gateway's own Unix socket (`rolltap gateway --unix-socket`),
        bound into sandboxes instead of a relay to its TCP address. `read_only_paths`: more
        host paths confined harnesses may read (a Node.js outside /usr, say). `image_cache`:
        where task images are unpacked (default: images.CacheConfig.from_env()). `pools`: the
        concurrency limits of the setup, agent and verification phases (default: none, only
        measured)."""
        if isolation not in ("bwrap", "none"):
            raise ValueError(f"isolation must be bwrap or none, not {isolation!r}")
        if isolation == "bwrap":
            confine.tools()
        self.root = root
        self.task_limits = task_limits or Limits()
        self.use_cgroup = use_cgroup
        self.keep_dirs = keep_dirs
        self.isolation: Isolation = isolation
        self.gateway_socket = gateway_socket
        self.read_only_paths = tuple(read_only_paths)
        # Expected tests by task content: collected once on the task's own files.
        self.expected: dict[str, frozenset[str]] = {}
        self.image_cache = image_cache
        self.pools = pools or PhasePools()

    async def aclose(self) -> None:
        """Nothing outlives its sandbox here."""

    async def run(self, request: SandboxRequest) -> SandboxResult:
        _check_urls(request)
        parent = sandbox_parent(self.root)
        root = make_root(parent, request.task.id)
        try:
            with contextlib.ExitStack() as stack:
                return await _Sandbox(self, request, root, parent).run(stack)
        finally:
            with contextlib.suppress(OSError):
                release_areas(root, keep=self.keep_dirs)
            if not self.keep_dirs:
                remove_tree(root)


def _check_urls(request: SandboxRequest) -> None:
    a, b = request.access.openai_base_url, request.access.anthropic_base_url
    if urlsplit(a).netloc != urlsplit(b).netloc:
        raise ValueError(f"the gateway's base URLs name different servers ({a}, {b})")

