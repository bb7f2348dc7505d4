"""Benchmark of task images (sandbox/images.py): start-up of a confined `true` on the host's
system, on an image whose root filesystem is cached (warm: the overlay mount is all it adds),
and on an image met for the first time (skopeo copy out of containers-storage + umoci unpack,
then the same `true`); plus a whole LocalBackend sandbox (harness and verifier `true`) on the
host and on the image. podman's start of the same image is measured when podman is installed.

The image is the registry-free base image (`rolltap image base`), built first if missing.
Medians in milliseconds.

Run: python -m bench.bench_images
"""

from __future__ import annotations

import asyncio
import os
import shutil
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


def _podman_ms(ref: str) -> str:
    podman = shutil.which("podman")
    if podman is None:
        return "not installed (it needs runc and a containers.conf here; see README)"
    times = []
    for _ in range(3):
        started = time.perf_counter()
        proc = subprocess.run([podman, "run", "--rm", "--network", "none", ref, "true"],
                              capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            return f"failed: {proc.stderr.strip().splitlines()[-1:]}"
        times.append((time.perf_counter() - started) * 1000)
    return f"{statistics.median(times):.1f}"


async def _run(print_fn) -> None:
    if not confine.own_uids():
        print_fn("skipped: task images need root")
        return
    ref = images.BASE_TAG
    if images.inspect(ref) is None:
        print_fn(f"building {ref} with mmdebstrap (once)...")
        images.base_image(ref)
    with tempfile.TemporaryDirectory(prefix="rolltap-bench-") as workdir:
        os.chmod(workdir, 0o777)
        host = await _median_ms(lambda: _process(True, workdir))
        with images.rootfs_for(ref) as rootfs:
            warm = await _median_ms(lambda: _image_true(rootfs, workdir))
        cold = statistics.median([await _first_unpack(ref, workdir)
                                  for _ in range(FIRST_UNPACK_ROUNDS)])
    sandbox_host = await _median_ms(lambda: _sandbox("bwrap"))
    sandbox_image = await _median_ms(lambda: _image_sandbox(ref))
    print_fn(f"{'median ms':<34}{'host':>10}{'image':>10}{'extra':>10}")
    print_fn(f"{'confined true, cache warm':<34}{host:>10.1f}{warm:>10.1f}{warm - host:>10.1f}")
    print_fn(f"{'confined true, first unpack':<34}{host:>10.1f}{cold:>10.1f}{cold - host:>10.1f}")
    print_fn(f"{'whole sandbox (2 phases)':<34}{sandbox_host:>10.1f}{sandbox_image:>10.1f}"
             f"{sandbox_image - sandbox_host:>10.1f}")
    print_fn(f"{'podman run --rm IMAGE true':<34}{'':>10}{_podman_ms(ref):>10}")
    print_fn(f"({ROUNDS} rounds warm, {FIRST_UNPACK_ROUNDS} first unpacks; image {ref}, "
             f"{images.inspect(ref).digest[:19]})")


def run(print_fn=print) -> None:
    """The section of `make bench` (as root; builds the base image once if it is missing)."""
    asyncio.run(_run(print_fn))


if __name__ == "__main__":
    run()
