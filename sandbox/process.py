"""Run one command contained: own session, rlimits, pids cgroup, optionally a private mount
namespace that hides paths (isolation.py), wall-clock timeout, bounded output, and nothing of
it left running afterwards.

The command runs under reaper.py, which kills and reaps the command's leftovers when it exits.
On timeout or cancellation the reaper is asked to stop (SIGTERM), then the whole session's
process group and the cgroup are killed whatever it did.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import msgspec

from sandbox import reaper
from sandbox.capture import BoundedBuffer, drain
from sandbox.cgroup import PidsCgroup
from sandbox.isolation import MountOp, enter
from sandbox.limits import Limits, make_preexec, nproc_budget, rlimit_table

ProcessStatus = Literal["ok", "crashed", "timeout"]

# How long the reaper gets to clean up after SIGTERM, and the output readers after the kill.
STOP_GRACE_S = 3.0
DRAIN_GRACE_S = 2.0


class ProcessOutcome(msgspec.Struct, frozen=True):
    status: ProcessStatus
    exit_code: int | None
    duration_s: float
    stdout: str
    stderr: str
    stdout_bytes: int
    stderr_bytes: int
    output_truncated: bool
    peak_pids: int | None = None
    process_cap: Literal["cgroup", "rlimit", "none"] = "none"


def classify(exit_code: int | None, timed_out: bool) -> ProcessStatus:
    if timed_out:
        return "timeout"
    return "ok" if exit_code == 0 else "crashed"


def _killpg(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


async def _stop(proc: asyncio.subprocess.Process) -> None:
    """Ask the reaper to clean up; force the whole group down if it does not in time."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(proc.wait(), STOP_GRACE_S)
    _killpg(proc.pid)
    if proc.returncode is None:
        await proc.wait()


def _with_mounts(
    preexec: Callable[[], None], mounts: Sequence[MountOp] | None, cwd: str
) -> Callable[[], None]:
    if mounts is None:
        return preexec

    def isolated() -> None:
        preexec()
        enter(mounts, cwd)

    return isolated


async def run_contained(
    argv: Sequence[str],
    *,
    cwd: str,
    env: Mapping[str, str],
    limits: Limits,
    timeout_s: float,
    use_cgroup: bool = True,
    mounts: Sequence[MountOp] | None = None,
) -> ProcessOutcome:
    """Run `argv` in `cwd` with exactly `env`; never leaves a process of it behind. With
    `mounts`, in a private mount namespace with them applied; if that cannot be set up the
    command does not run and this raises (subprocess.SubprocessError)."""
    cgroup = (
        PidsCgroup.create(limits.max_procs)
        if use_cgroup and limits.max_procs is not None
        else None
    )
    nproc = nproc_budget(limits)
    cap = "cgroup" if cgroup else ("rlimit" if nproc is not None else "none")
    preexec = _with_mounts(
        make_preexec(rlimit_table(limits, nproc), cgroup.procs_file if cgroup else None),
        mounts,
        cwd,
    )
    out, err = BoundedBuffer(limits.output_bytes), BoundedBuffer(limits.output_bytes)
    started = time.monotonic()
    timed_out = False
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-I",
            "-S",
            reaper.__file__,
            *argv,
            cwd=cwd,
            env=dict(env),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
            preexec_fn=preexec,
        )
        readers = [
            asyncio.ensure_future(drain(proc.stdout, out)),
            asyncio.ensure_future(drain(proc.stderr, err)),
        ]
        try:
            try:
                await asyncio.wait_for(proc.wait(), timeout_s)
            except TimeoutError:
                timed_out = True
            finally:
                # Runs on timeout, on normal exit (stragglers) and on cancellation alike.
                await asyncio.shield(_stop(proc))
                if cgroup is not None:
                    await asyncio.shield(cgroup.kill_all())
            await asyncio.wait(readers, timeout=DRAIN_GRACE_S)
        finally:
            for task in readers:
                task.cancel()
        duration = time.monotonic() - started
        exit_code = None if timed_out else proc.returncode
        return ProcessOutcome(
            status=classify(exit_code, timed_out),
            exit_code=exit_code,
            duration_s=duration,
            stdout=out.text(),
            stderr=err.text(),
            stdout_bytes=out.total,
            stderr_bytes=err.total,
            output_truncated=out.truncated or err.truncated,
            peak_pids=cgroup.peak() if cgroup else None,
            process_cap=cap,
        )
    finally:
        if cgroup is not None:
            await asyncio.shield(cgroup.kill_all())
            await asyncio.shield(cgroup.remove())
