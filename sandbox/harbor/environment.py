"""rolltap's bubblewrap sandbox as a Harbor environment (`--environment bwrap`, the default).

Harbor assumes one persistent environment per trial: a server an agent starts in one `exec`
(terminus-2's tmux, a task's service) must still be there in the next. So each trial gets one
long-lived bubblewrap sandbox, and every `exec`, upload and download enters it with `nsenter`
(as root on the host) instead of starting a sandbox of its own.

What the sandbox is, as the README's Isolation section promises for rolltap's own sandboxes:
- its own user, PID, mount, IPC, UTS, network and cgroup namespaces (`bwrap --unshare-all`),
  further user namespaces disabled; root inside is a fresh unprivileged host uid (confine.py's
  uids), so nothing the agent does as "root" is root on the host;
- a filesystem built from nothing: a size-bounded tmpfs root (the task's workdir, /logs, /tmp,
  /tests, /solution all live there) with the host's system directories bound read-only; the
  task set, the runner's state and other sandboxes are not in it;
- a network namespace with only loopback; the gateway, and nothing else, is reachable through a
  Unix socket bound in and forwarded by socat on 127.0.0.1 (relay.py), when `gateway_url` is
  given (environment kwarg; the runner gives it);
- limits: one cgroup per trial (memory without swap, CPUs, processes) from the task's
  `cpus` and `memory_mb` (rolltap's defaults otherwise), which the sandbox and every exec
  join before their first instruction (cgroup.py), and the tmpfs root's size (`storage_mb`,
  else the `disk_mb` kwarg);
- no environment of the worker's: each exec starts from an empty environment plus what Harbor
  passes (the rollout key only in agent-phase execs, as Harbor scopes AgentConfig.env).

A task with an image (`[environment].docker_image`, else `environment/Dockerfile`) runs on it
(`rootfs=image`, the default): sandbox/images.py finds, pulls or builds it (buildah runs the
Dockerfile's COPY and RUN steps) and holds its unpacked root for the trial, and a root stage
(confine.py's, as for rolltap's own image sandboxes) mounts it as `/` under an overlay whose
writable layer is a tmpfs of the trial's disk size in the stage's own mount namespace: what a
trial writes reaches neither the image cache nor another trial, and vanishes with the sandbox.
The sandbox's root owns `/` and the task's workdir, /logs and /root (copied up); the rest of the
image stays the image's root's, read-only to it, as the host's system directories are. The
host's system directories are then at HOST_ROOT, for socat, run with the host's loader
(hostexec.py). An image that cannot be had (offline and not in containers-storage, a failed
build) fails the environment's start: an infrastructure failure, never a wrong answer.
`rootfs=host` (environment kwarg) runs on the host's system directories instead, as a task
without an image always does.
Files move in and out as tar streams through an exec, never through /proc/PID/root, so a
symlink the agent planted cannot point a copy at the host.

The verifier phase (from Harbor's verification-start event, which the worker hands on:
begin_verification) runs every exec, upload and download as another fresh host uid, in a view
of its own that one holder process keeps (verifier_view.py): the agent's processes go on
running, but nothing the agent left can reach the verifier's files, processes or environment.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import shlex
import shutil
import signal
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from harbor.environments.base import BaseEnvironment, ExecResult
from harbor.environments.capabilities import EnvironmentCapabilities

from sandbox import hostexec, images
from sandbox.cgroup import Cgroup
from sandbox.confine import (
    GATEWAY_SOCKET,
    NO_IMAGE_WITHOUT_ROOT,
    Image,
    Phase,
    View,
    mount_points,
    new_uid,
    outer_args,
    own_uids,
    ro_binds,
    stage_plan,
    stage_script,
    tools,
)
from sandbox.harbor import seal as seal_module
from sandbox.harbor.argv import (
    PATH,
    bind_parents,
    exec_argv,
    image_source,
    sandbox_argv,
    system_layout,
)
from sandbox.limits import make_preexec
from sandbox.relay import Relay, inside_port

# rolltap's sandbox defaults, where the task's [environment] gives no cpus / memory_mb.
DEFAULT_CPUS = 1.0
DEFAULT_MEMORY_MB = 4096
MAX_PROCS = 4096
STARTUP_S = 30.0
VIEW_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "verifier_view.py")
# The verifier's view holds a copy of the workdir's top directory besides its own files; the
# copy of a large workdir (a repository) may take a while on a loaded machine.
VERIFIER_MARGIN_MB = 256
VIEW_START_S = 300.0
# Waits for socat's listening socket in the sandbox's own /proc/net/tcp.
FORWARDER = (
    "setsid {socat} TCP-LISTEN:{port},bind=127.0.0.1,fork,reuseaddr UNIX-CONNECT:{sock} "
    "</dev/null >/dev/null 2>&1 & "
    "for i in $(seq 1000); do grep -q ':{hex} 00000000:0000 0A' /proc/net/tcp && exit 0; "
    "sleep 0.01; done; echo 'rolltap: the gateway forwarder did not start' >&2; exit 125"
)


class BwrapEnvironment(BaseEnvironment):
    """One persistent bubblewrap sandbox per trial. Kwargs: gateway_url (the gateway the
    sandbox may reach), disk_mb (its tmpfs root, or its image overlay's writable layer;
    default 1024), ro_paths (host paths bound read-only at their own paths, e.g. the project's
    pinned harness CLIs, so that agents find them instead of installing from the network),
    path (directories put first on PATH) and rootfs (`image`: the task's image when it names
    one, the default; `host`: the host's system directories), seal (the verifier's pytest
    runs: `judge` them against seal_expected, each run's expected tests; `collect` the
    expected tests, with the workdir's modules stubbed when seal_stub; `off`, the default: no
    seal, as with any other Harbor environment; see seal.py)."""

    def __init__(self, *args, gateway_url: str | None = None, disk_mb: int | str = 1024,
                 ro_paths: Sequence[str] | str = (), path: Sequence[str] | str = (),
                 rootfs: str = "image", seal: str = "off",
                 seal_expected: list[list[str]] | None = None, seal_stub: bool = False,
                 **kwargs) -> None:
        if seal not in ("off", "collect", "judge"):
            raise ValueError(f"seal={seal!r}: give judge, collect or off")
        self._seal_mode, self._seal_stub = seal, bool(seal_stub)
        self._seal_expected = [list(tests) for tests in seal_expected or []]
        self._seal: seal_module.Pipes | None = None
        self.seal_report: seal_module.SealReport | None = None
        if rootfs not in ("image", "host"):
            raise ValueError(f"rootfs={rootfs!r}: give rootfs=image (the task's image) or "
                             f"rootfs=host (the host's system directories)")
        self._use_image = rootfs == "image"
        self._image_hold = contextlib.ExitStack()
        self._overlay: str | None = None
        self._gateway_url = gateway_url
        self._read_only = tuple(_paths(ro_paths))
        self._path = ":".join([*_paths(path), PATH])
        self._disk_mb = int(disk_mb)
        self._process: asyncio.subprocess.Process | None = None
        self._pid: int | None = None
        self._relay: Relay | None = None
        self._cgroup: Cgroup | None = None
        self._agent_uid: int | None = None  # the sandbox's root on the host (as root only)
        self._system = system_layout("/")
        self._verifier: _Verifier | None = None
        super().__init__(*args, **kwargs)

    @staticmethod
    def type() -> str:
        return "rolltap-bwrap"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        # Its network reaches the gateway at most: "no-network" tasks are honoured too.
        return EnvironmentCapabilities(disable_internet=True)

    def _validate_definition(self) -> None:
        pass  # a task without an image runs on the host's system directories

    async def _image_root(self) -> str | None:
        """The task's unpacked image, held until stop(); None without one (or with
        rootfs=host). Raises with what to do when it cannot be had."""
        ref, dockerfile = image_source(self.task_env_config.docker_image, self.environment_dir)
        if not self._use_image or (ref is None and dockerfile is None):
            return None
        if not own_uids():
            raise RuntimeError(f"{NO_IMAGE_WITHOUT_ROOT} Or run on the host's system "
                               f"directories: --environment-kwarg rootfs=host")
        try:
            return await asyncio.to_thread(self._image_hold.enter_context,
                                           images.rootfs_for(ref, dockerfile))
        except images.ImageError as exc:
            raise RuntimeError(f"the task's image: {exc}") from None

    def _argv(self, bwrap: str, setpriv: str | None, disk_mb: int, socket: str | None,
              info_fd: int, rootfs: str | None) -> list[str]:
        if not own_uids():
            return sandbox_argv(bwrap, disk_mb, socket, info_fd, self._read_only)
        assert setpriv is not None  # `tools()` refuses root without it
        uid = self._agent_uid = new_uid()
        if rootfs is None:
            return [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--",
                    *sandbox_argv(bwrap, disk_mb, socket, info_fd, self._read_only)]
        self._system = system_layout(rootfs)
        self._overlay = tempfile.mkdtemp(prefix="rolltap-harbor-overlay-")
        image = Image(rootfs, self._overlay)
        phase = Phase(View(tuple(ro_binds(self._read_only)), gateway_socket=socket,
                           image=image), uid, "/", ())
        staged = stage_plan(phase)
        script = stage_script(image, staged, mount_points(phase, os.path.isdir),
                              size_mb=disk_mb, owner=uid,
                              owned=(self._workdir, "/logs", "/root"))
        return [*outer_args(phase, staged, {self._overlay}, bwrap=bwrap, setpriv=setpriv,
                            image_step=["/bin/sh", "-c", script, "rolltap-image"]),
                *sandbox_argv(bwrap, disk_mb, socket, info_fd, self._read_only, staged)]

    @property
    def _workdir(self) -> str:
        return self.task_env_config.workdir or "/"

    async def start(self, force_build: bool) -> None:
        bwrap, setpriv = tools()
        rootfs = await self._image_root()
        socket = None
        if self._gateway_url:
            self._relay = await Relay.start(self._gateway_url)
            socket = self._relay.path
            os.chmod(os.path.dirname(socket), 0o711)  # the sandbox's uid binds it
        config = self.task_env_config
        self._cgroup = Cgroup.create({
            "memory": config.memory_mb or DEFAULT_MEMORY_MB,
            "cpu": config.cpus or DEFAULT_CPUS, "pids": MAX_PROCS})
        read_fd, write_fd = os.pipe()
        argv = self._argv(bwrap, setpriv, config.storage_mb or self._disk_mb, socket, write_fd,
                          rootfs)
        try:
            self._process = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, pass_fds=(write_fd,), start_new_session=True,
                preexec_fn=self._join_cgroup())
        finally:
            os.close(write_fd)
        info = await asyncio.wait_for(
            asyncio.get_running_loop().run_in_executor(None, _read_all, read_fd), STARTUP_S)
        assert self._process.stdout is not None
        ready = await asyncio.wait_for(self._process.stdout.readline(), STARTUP_S)
        if not info or ready != b"ready\n":
            err = await self._process.stderr.read() if self._process.stderr else b""
            raise RuntimeError(f"the bwrap sandbox did not start: {err.decode(errors='replace')}")
        self._pid = json.loads(info)["child-pid"]
        dirs = ["/logs/agent", "/logs/verifier", "/logs/artifacts", self._workdir]
        await self._must(f"mkdir -p {' '.join(shlex.quote(d) for d in dirs)}")
        if parents := bind_parents(self._read_only):
            # bwrap makes the directories above a bind 0700, which only the sandbox's root
            # may enter: the verifier, another uid, could not reach what is bound there.
            await self._must(f"chmod a+rx {' '.join(map(shlex.quote, parents))} 2>/dev/null "
                             "|| true")
        if self._gateway_url:
            port = inside_port(self._gateway_url)
            socat = shlex.join(hostexec.wrap(["socat"])) if rootfs else "socat"
            await self._must(FORWARDER.format(socat=socat, port=port, sock=GATEWAY_SOCKET,
                                              hex=f"{port:04X}"))
        await self._upload_environment_dir_after_start()

    def _join_cgroup(self):
        return make_preexec([], self._cgroup.procs_files if self._cgroup else [])

    async def _must(self, command: str) -> None:
        result = await self.exec(command, cwd="/", env={}, timeout_sec=60)
        if result.return_code != 0:
            raise RuntimeError(f"sandbox setup failed ({command!r}): {result.stderr}")

    async def begin_verification(self) -> None:
        """Harbor's verification starts: from here on every exec, upload and download runs as
        a fresh host uid in the verifier's own view (verifier_view.py). The agent's processes
        keep running (a service must still answer the tests) but reach nothing of it. Without
        root there is no other uid to run as: the verifier runs as the sandbox's root, as in
        rolltap's own sandboxes without root."""
        if self._agent_uid is None or self._pid is None or self._verifier is not None:
            return
        uid = self._agent_uid
        while uid == self._agent_uid:
            uid = new_uid()
        config = self.task_env_config
        top = PurePosixPath(self._workdir).parts[1:2]
        spec = {"pid": self._pid, "uid": uid, "agent_uid": self._agent_uid,
                "size_mb": (config.storage_mb or self._disk_mb) + VERIFIER_MARGIN_MB,
                "system": self._system, "copy": top[0] if top else None,
                "workdir": self._workdir}
        if self._seal_mode != "off":
            spec["seal"] = {"dir": seal_module.SEAL_DIR, "files": seal_module.view_files()}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", VIEW_SCRIPT, json.dumps(spec),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, start_new_session=True, env={"PATH": PATH},
            preexec_fn=self._join_cgroup())
        assert proc.stdout is not None and proc.stderr is not None
        line = await asyncio.wait_for(proc.stdout.readline(), VIEW_START_S)
        if not line.startswith(b"ready "):
            await proc.wait()
            err = (await proc.stderr.read()).decode(errors="replace")
            raise RuntimeError(f"the verifier's view did not start: {err}")
        home = "/tmp" if spec["copy"] == "root" else "/root"
        self._verifier = _Verifier(proc, int(line.split()[1]), uid, home)
        if self._seal_mode != "off":
            self._seal = seal_module.Pipes.open(self._seal_mode == "collect", self._seal_stub)

    async def end_verification(self) -> None:
        """An agent phase starts again (a multi-step task's next step): the verifier's
        processes and view go; the agent never sees them."""
        verifier, self._verifier = self._verifier, None
        if verifier is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(verifier.process.pid, signal.SIGKILL)
        for pid in self._cgroup.pids() if self._cgroup else []:
            with contextlib.suppress(OSError):
                if os.stat(f"/proc/{pid}").st_uid == verifier.uid:
                    os.kill(pid, signal.SIGKILL)
        await verifier.process.wait()
        if self._seal is not None:
            pipes, self._seal = self._seal, None
            channel = await pipes.close()
            self.seal_report = (
                seal_module.collect_report(channel, pipes.setups)
                if self._seal_mode == "collect" else
                seal_module.judge_report(channel, pipes.setups, self._seal_expected))

    async def stop(self, delete: bool) -> None:
        await self.end_verification()
        if self._process is not None and self._process.returncode is None:
            # Killing the session ends setpriv/bwrap; bwrap's init then takes every process
            # of the sandbox's PID namespace with it.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._process.pid, signal.SIGKILL)
            await self._process.wait()
        if self._cgroup is not None:  # whatever an exec left behind outside the sandbox's init
            await self._cgroup.kill_all()
            await self._cgroup.remove()
            self._cgroup = None
        if self._relay is not None:
            await self._relay.close()
            self._relay = None
        # The overlay's tmpfs went with the sandbox's mount namespaces; its mount point and
        # the image's hold are left.
        if self._overlay is not None:
            shutil.rmtree(self._overlay, ignore_errors=True)
            self._overlay = None
        self._image_hold.close()
        self._pid = None  # a separate verifier's phase then finds no sandbox to enter

    async def _run(self, command: str, cwd: str | None, env: dict[str, str] | None,
                   timeout_sec: float | None, stdin: bytes | None = None
                   ) -> tuple[int, bytes, bytes]:
        if self._pid is None:
            raise RuntimeError("the environment is not started")
        fds: tuple[int, ...] = ()
        if (verifier := self._verifier) is not None:
            # The verifier's PATH is the system's only (the agent's pinned CLIs are not its),
            # after the seal's shims; the seal's pipes are its children's.
            own = {"HOME": verifier.home, **(env or {})}
            path = PATH
            if (pipes := self._seal) is not None:
                fds = (pipes.key_r, pipes.report_w)
                own.update(seal_module.env(*fds))
                path = seal_module.path(PATH)
            argv = exec_argv(verifier.holder, command, cwd or self._workdir, own, path,
                             verifier.uid)
        else:
            argv = exec_argv(self._pid, command, cwd or self._workdir, env or {}, self._path)
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE if stdin is not None else
            asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, start_new_session=True, env={"PATH": PATH},
            preexec_fn=self._join_cgroup(), pass_fds=fds)
        try:
            out, err = await asyncio.wait_for(proc.communicate(stdin), timeout_sec)
        except (TimeoutError, asyncio.CancelledError):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            raise
        return proc.returncode or 0, out, err

    async def exec(self, command: str, cwd: str | None = None,
                   env: dict[str, str] | None = None, timeout_sec: int | None = None,
                   user: str | int | None = None) -> ExecResult:
        user = self._resolve_user(user)
        if user not in (None, "root", 0, "0"):
            # Only root is mapped in the sandbox's user namespace (and it is no host root).
            self.logger.warning(f"bwrap environment runs {user!r}'s command as its root")
        try:
            code, out, err = await self._run(command, cwd, self._merge_env(env), timeout_sec)
        except TimeoutError as exc:
            raise TimeoutError(f"command timed out after {timeout_sec} s: {command}") from exc
        return ExecResult(stdout=out.decode(errors="replace"),
                          stderr=err.decode(errors="replace"), return_code=code)

    async def _tar_in(self, archive: bytes, target_dir: str) -> None:
        code, _, err = await self._run(
            f"mkdir -p {shlex.quote(target_dir)} && tar -xf - -C {shlex.quote(target_dir)}",
            "/", {}, None, stdin=archive)
        if code != 0:
            raise RuntimeError(f"upload to {target_dir} failed: {err.decode(errors='replace')}")

    async def _tar_out(self, source_dir: str, member: str) -> bytes:
        code, out, err = await self._run(
            f"tar -cf - -C {shlex.quote(source_dir)} {shlex.quote(member)}", "/", {}, None)
        if code != 0:
            raise RuntimeError(f"download of {source_dir}/{member} failed: "
                               f"{err.decode(errors='replace')}")
        return out

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        target = PurePosixPath(target_path)
        await self._tar_in(_archive(Path(source_path), target.name), str(target.parent))

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        await self._tar_in(_archive(Path(source_dir), "."), target_dir)

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        source = PurePosixPath(source_path)
        data = await self._tar_out(str(source.parent), source.name)
        target = Path(target_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as staging:
            _extract(data, staging)
            os.replace(os.path.join(staging, source.name), target)

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        Path(target_dir).mkdir(parents=True, exist_ok=True)
        _extract(await self._tar_out(source_dir, "."), str(target_dir))


@dataclass(frozen=True)
class _Verifier:
    """The verifier phase's view: its holder process (`process`, the session killed at the
    end; `holder`, the PID execs enter), the verifier's host uid and HOME."""

    process: asyncio.subprocess.Process
    holder: int
    uid: int
    home: str


def _paths(value: Sequence[str] | str) -> list[str]:
    """A kwarg given as a list, or from the command line as one string of paths split by
    ':'."""
    parts = value.split(":") if isinstance(value, str) else list(value)
    return [os.path.abspath(p) for p in parts if p]


def _read_all(fd: int) -> bytes:
    with os.fdopen(fd, "rb") as f:
        return f.read()


def _archive(path: Path, name: str) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        tar.add(str(path), arcname=name)
    return buffer.getvalue()


def _extract(data: bytes, where: str) -> None:
    # "data": no absolute paths, no links out of `where`, no devices: the sandbox wrote it.
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(where, filter="data")
