"""Run each sandbox as a Ray task, so rollouts spread over a cluster.

The Ray task runs the same LocalBackend on whichever node Ray picks; request and result are
plain records (the task's files travel inside the request, so nodes need no shared disk). The
gateway URLs in the request must be reachable from the nodes. The admin key is never part of a
request. Cancelling `run` cancels the Ray task, which interrupts the worker's event loop and so
kills the sandbox's processes like a local cancellation does. Ray delivers that interrupt when
it can; a task still running `FORCE_AFTER_S` later is cancelled by force, which kills its
worker and so, by bwrap's --die-with-parent, the sandbox.

Placement: tasks are SPREAD over the cluster's nodes (Ray's default packs a node before using
the next), and a sandbox may reserve custom resources besides CPUs, so each node's own count
of them (`ray start --resources '{"sandbox": 8}'`) bounds how many run there. The node a
sandbox ran on is in its result's metrics (`ray_node`).

A node that dies takes its sandboxes with it (bwrap's --die-with-parent ends them with their
Ray worker). Ray does not retry the task (a second run would put a second rollout into the
group); `run` raises, and the runner finishes the rollout as failed with no reward
(unscorable) and counts it among the run's errors.

Needs the `ray` extra (`pip install 'rolltap[ray]'`); imported only when this backend is used.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import Coroutine
from typing import Any

import msgspec

from sandbox.backends.base import SandboxRequest, SandboxResult
from sandbox.backends.local import LocalBackend

FORCE_AFTER_S = 20.0


def ray_resource(spec: str) -> tuple[str, float]:
    """`--ray-resource NAME=AMOUNT`: a custom resource and how much of it a sandbox reserves."""
    name, _, amount = spec.partition("=")
    try:
        value = float(amount)
    except ValueError:
        value = -1.0
    if not name.strip() or not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(
            f"{spec!r}: write NAME=AMOUNT with AMOUNT > 0, e.g. sandbox=1")
    return name.strip(), value


async def _cancelled_once(run: Coroutine[Any, Any, SandboxResult]) -> SandboxResult:
    """Awaits `run`, cancelling it at the first interrupt of the worker and ignoring the rest.

    Ray cancels a running task by interrupting the worker's main thread, and repeats that while
    the task still runs. asyncio.run's own handler cancels at the first interrupt but raises
    KeyboardInterrupt at the next, which can land in the sandbox's clean-up (a stop that waits
    for the sandbox to exit) and abort it, leaving the sandbox running on an idle worker."""
    task, loop = asyncio.current_task(), asyncio.get_running_loop()
    assert task is not None
    interrupted = False

    def on_interrupt(signum: int, frame: Any) -> None:
        nonlocal interrupted
        if not interrupted:
            interrupted = True
            loop.call_soon_threadsafe(task.cancel)

    previous = signal.signal(signal.SIGINT, on_interrupt)
    try:
        return await run
    finally:
        signal.signal(signal.SIGINT, previous)


def run_in_worker(request: SandboxRequest, local_options: dict[str, Any]) -> SandboxResult:
    import ray

    result = asyncio.run(_cancelled_once(LocalBackend(**local_options).run(request)))
    node = ray.get_runtime_context().get_node_id()
    return msgspec.structs.replace(result, extra_metrics={**result.extra_metrics,
                                                          "ray_node": node})


class RayBackend:
    def __init__(
        self,
        *,
        address: str | None = None,
        num_cpus: float = 1.0,
        resources: dict[str, float] | None = None,
        init_options: dict[str, Any] | None = None,
        **local_options: Any,
    ) -> None:
        """`address`: a running cluster ("auto", "ray://host:10001"); None starts a local Ray
        unless one is initialised already. `num_cpus`: CPUs a sandbox reserves, which bounds
        how many run per node; `resources`: custom resources it reserves too. `local_options`:
        passed to LocalBackend on the node."""
        import ray

        self._ray = ray
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(address=address, **(init_options or {}))
        self._remote = ray.remote(
            num_cpus=num_cpus, resources=resources or {}, max_retries=0,
            scheduling_strategy="SPREAD",
        )(run_in_worker)
        self._local_options = local_options
        self._forcing: set[asyncio.Task[None]] = set()

    async def aclose(self) -> None:
        """Nothing outlives its sandbox here (the Ray session is the process's)."""

    async def run(self, request: SandboxRequest) -> SandboxResult:
        ref = self._remote.remote(request, self._local_options)
        try:
            return await ref
        except asyncio.CancelledError:
            self._ray.cancel(ref)
            forcing = asyncio.get_running_loop().create_task(self._force_cancel(ref))
            self._forcing.add(forcing)
            forcing.add_done_callback(self._forcing.discard)
            raise

    async def _force_cancel(self, ref: Any) -> None:
        """Cancels `ref` by force if the polite cancel has not ended it in `FORCE_AFTER_S`."""
        done, _ = await asyncio.to_thread(self._ray.wait, [ref], timeout=FORCE_AFTER_S)
        if not done:
            self._ray.cancel(ref, force=True)

    def close(self) -> None:
        if self._owns_ray:
            self._ray.shutdown()
