"""Benchmark of task images (sandbox/images.py): start-up of a confined `true` on the host's
system, on an image whose root filesystem is cached (warm: the overlay mount is all it adds),
and on an image met for the first time (skopeo copy out of containers-storage + umoci unpack,
then the same `true`); plus a whole LocalBackend sandbox (harness and verifier `true`) on the
host and on the image. podman's start of the same image is beside the warm one, where podman runs
(`make bench-deps`).

The image is the registry-free base image (`rolltap image base`), built first if missing.
Medians in milliseconds.

Run: python -m bench.bench_images
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import tempfile
import time

import msgspec

from bench.bench_sandbox import ACCESS, ROUNDS, TASK, _median_ms, _process, _sandbox
from sandbox import confine, images
from sandbox.backends.base import SandboxRequest
from sandbox.backends.local import LocalBackend
from sandbox.confine import Bind, Image, Phase, View
from sandbox.harbor import podman
from sandbox.limits import Limits
from sandbox.presets import Harness
from sandbox.process import run_contained

FIRST_UNPACK_ROUNDS = 2


async def _image_true(rootfs: str, workdir: str) -> None:
    with tempfile.TemporaryDirectory(prefix="rolltap-bench-overlay-") as overlay:
        view = View(binds=(Bind(workdir, "/sandbox/work", True),), image=Image(rootfs, overlay))
        phase = Phase(view, confine.new_uid(), "/sandbox/work", ("true",))
        outcome = await run_contained(confine.command(phase), cwd=workdir,
                                      env={"PATH": "/usr/bin:/bin"}, limits=Limits(),
                                      timeout_s=60, confined=True, own_uid=True)
    assert outcome.exit_code == 0, outcome.stderr


async def _first_unpack(ref: str, workdir: str) -> float:
    """One cold start: a fresh cache, the image unpacked into it, one confined `true`."""
    with tempfile.TemporaryDirectory(prefix="rolltap-bench-cache-",
                                     dir=images.Cache().path) as path:
        cache = images.Cache(images.CacheConfig(path))
        started = time.perf_counter()
        with images.rootfs_for(ref, cache=cache) as rootfs:
            await _image_true(rootfs, workdir)
        return (time.perf_counter() - started) * 1000


async def _image_sandbox(ref: str) -> None:
    task = msgspec.structs.replace(TASK, image=ref)
    harness = Harness(preset="command", model="m", command="true")
    result = await LocalBackend().run(SandboxRequest(task, harness, ACCESS))
    assert result.reward == 1.0, (result.reward_detail, result.agent and result.agent.stderr)


def _podman_ms(ref: str) -> tuple[float | None, str]:
    """podman's median start of the same `true` in the same image (runc, no network), or None
    and why not."""
    why = podman.missing()
    if why is not None:
        return None, why
    times = []
    for _ in range(ROUNDS):
        started = time.perf_counter()
        proc = subprocess.run(["podman", "run", "--rm", "--network", "none", ref, "true"],
                              capture_output=True, text=True, timeout=300,
                              env={**os.environ, **podman.env()})
        if proc.returncode != 0:
            return None, f"podman run failed: {proc.stderr.strip().splitlines()[-1:]}"
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times), ""


def base_ref(print_fn) -> str:
    """The registry-free base image, built once when containers-storage lacks it."""
    if images.inspect(images.BASE_TAG) is None:
        print_fn(f"building {images.BASE_TAG} with mmdebstrap (once)...")
        images.base_image(images.BASE_TAG)
    return images.BASE_TAG


async def _run(print_fn) -> None:
    if not confine.own_uids():
        print_fn("skipped: task images need root")
        return
    ref = base_ref(print_fn)
    with tempfile.TemporaryDirectory(prefix="rolltap-bench-") as workdir:
        os.chmod(workdir, 0o777)
        host = await _median_ms(lambda: _process(True, workdir))
        with images.rootfs_for(ref) as rootfs:
            warm = await _median_ms(lambda: _image_true(rootfs, workdir))
        cold = statistics.median([await _first_unpack(ref, workdir)
                                  for _ in range(FIRST_UNPACK_ROUNDS)])
    sandbox_host = await _median_ms(lambda: _sandbox("bwrap"))
    sandbox_image = await _median_ms(lambda: _image_sandbox(ref))
    podman_ms, why = _podman_ms(ref)
    podman_cell = f"{podman_ms:>10.1f}" if podman_ms is not None else f"{'-':>10}"
    print_fn(f"{'median ms':<34}{'host':>10}{'image':>10}{'extra':>10}{'podman':>10}")
    print_fn(f"{'confined true, cache warm':<34}{host:>10.1f}{warm:>10.1f}{warm - host:>10.1f}"
             f"{podman_cell}")
    print_fn(f"{'confined true, first unpack':<34}{host:>10.1f}{cold:>10.1f}{cold - host:>10.1f}")
    print_fn(f"{'whole sandbox (2 phases)':<34}{sandbox_host:>10.1f}{sandbox_image:>10.1f}"
             f"{sandbox_image - sandbox_host:>10.1f}")
    if podman_ms is None:
        print_fn(f"podman: no row ({why})")
    else:
        print_fn("(podman: `podman run --rm --network none IMAGE true`, runc, image in "
                 "containers-storage: nothing to unpack)")
    print_fn(f"({ROUNDS} rounds warm, {FIRST_UNPACK_ROUNDS} first unpacks; image {ref}, "
             f"{images.inspect(ref).digest[:19]})")


def run(print_fn=print) -> None:
    """The section of `make bench` (as root; builds the base image once if it is missing)."""
    asyncio.run(_run(print_fn))


if __name__ == "__main__":
    run()
