"""Run one command contained: own session, rlimits, cgroup, wall-clock timeout, bounded
output, and nothing of it left running afterwards.

A confined command (a bwrap command line from confine.py) has its own PID namespace, which dies
with it. An unconfined one runs under reaper.py, which kills and reaps the command's leftovers
when it exits. On timeout or cancellation the command (or the reaper) is asked to stop
(SIGTERM), then the whole session's process group and the cgroup are killed whatever it did.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Literal

import msgspec

from sandbox import reaper
from sandbox.capture import BoundedBuffer, drain
from sandbox.cgroup import Cgroup
from sandbox.limits import Limits, cgroup_limits, make_preexec, nproc_budget, rlimit_table

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
    peak_memory_mb: int | None = None
    cgroup: tuple[str, ...] = ()  # controllers whose limits held


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


async def _spawn(argv: Sequence[str], **kwargs) -> asyncio.subprocess.Process:
    """`asyncio.create_subprocess_exec`, safe to cancel. The command runs as soon as the call
    forks, before its pipes are connected; cancelled in between, asyncio kills only the direct
    child and then waits for the pipes to close, which the command's own children hold open: the
    cancellation would wait for them to end on their own. So the start is shielded, and a
    cancelled one is stopped here like any other run."""
    spawning = asyncio.ensure_future(asyncio.create_subprocess_exec(*argv, **kwargs))
    try:
        return await asyncio.shield(spawning)
    except asyncio.CancelledError:
        proc = await spawning
        await asyncio.shield(_stop(proc))
        raise


async def run_contained(
    argv: Sequence[str],
    *,
    cwd: str,
    env: Mapping[str, str],
    limits: Limits,
    timeout_s: float,
    use_cgroup: bool = True,
    confined: bool = False,
    own_uid: bool = False,
    pass_fds: Sequence[int] = (),
) -> ProcessOutcome:
    """Run `argv` in `cwd` with exactly `env`; never leaves a process of it behind.

    `confined`: `argv` starts its own PID namespace (bwrap), so no reaper is needed.
    `own_uid`: it runs as a uid no other process uses, so RLIMIT_NPROC is its own count.
    """
    cgroup = Cgroup.create(cgroup_limits(limits)) if use_cgroup else None
    nproc = nproc_budget(limits, own_uid)
    if cgroup and "pids" in cgroup.controllers and limits.max_procs is not None:
        cap = "cgroup"
    else:
        cap = "rlimit" if nproc is not None else "none"
    preexec = make_preexec(rlimit_table(limits, nproc), cgroup.procs_files if cgroup else [])
    command = list(argv) if confined else [sys.executable, "-I", "-S", reaper.__file__, *argv]
    out, err = BoundedBuffer(limits.output_bytes), BoundedBuffer(limits.output_bytes)
    started = time.monotonic()
    timed_out = False
    try:
        proc = await _spawn(
            command,
            cwd=cwd,
            env=dict(env),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
            preexec_fn=preexec,
            pass_fds=tuple(pass_fds),
        )
        assert proc.stdout is not None and proc.stderr is not None  # both piped
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
            peak_pids=cgroup.peak_pids() if cgroup else None,
            process_cap=cap,
            peak_memory_mb=cgroup.peak_memory_mb() if cgroup else None,
            cgroup=cgroup.controllers if cgroup else (),
        )
    finally:
        if cgroup is not None:
            await asyncio.shield(cgroup.kill_all())
            await asyncio.shield(cgroup.remove())
