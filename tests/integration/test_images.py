"""Task images (sandbox/images.py, hostexec.py, the image seam of confine.py).

Pure parts property-tested; then real images, offline: a Debian base image made from Debian's
packages by mmdebstrap (built once per package list and kept in containers-storage; unpacked
once into `.cache/images`), a Dockerfile task built by buildah on it, and real confined
sandboxes on both with the `command` harness (the host's python, run inside the image by the
host's loader).
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import shlex
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sandbox import confine, disk, hostexec, images
from sandbox.backends.base import RolloutAccess, SandboxRequest
from sandbox.backends.local import LocalBackend
from sandbox.confine import Bind, Image, Phase, View
from sandbox.images import Entry, context_digest, evictions
from sandbox.presets import Harness
from sandbox.tasks import Task, load_tasks

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="image overlays need root")
ACCESS = RolloutAccess("r-img", "rk-img", "http://127.0.0.1:9/v1", "http://127.0.0.1:9")
VERIFY = "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -m pytest -q -p no:cacheprovider tests_hidden"
# Only on the host: the image has no bubblewrap.
HOST_ONLY = "/usr/bin/bwrap"

# ---- pure -----------------------------------------------------------------------------------

contexts = st.dictionaries(st.text("ab/", min_size=1, max_size=4),
                           st.tuples(st.sampled_from([0o644, 0o755]), st.binary(max_size=8)),
                           max_size=4)


@given(contexts, st.randoms())
def test_context_digest_is_order_free_and_sees_every_change(files, rnd):
    shuffled = list(files.items())
    rnd.shuffle(shuffled)
    assert context_digest(dict(shuffled)) == context_digest(files)
    for name, (mode, data) in files.items():
        assert context_digest(files | {name: (mode, data + b"x")}) != context_digest(files)
        assert context_digest(files | {name: (mode ^ 0o100, data)}) != context_digest(files)
        renamed = {k: v for k, v in files.items() if k != name} | {name + "x": (mode, data)}
        if name + "x" not in files:
            assert context_digest(renamed) != context_digest(files)


entries = st.lists(st.tuples(st.integers(1, 100), st.floats(0, 100)), max_size=8).map(
    lambda xs: [Entry(f"sha256:{i:064x}", f"img{i}", size, used)
                for i, (size, used) in enumerate(xs)])


@given(entries, st.integers(0, 400), st.sets(st.integers(0, 7)))
def test_evictions_least_recently_used_first_never_busy(es, max_bytes, busy_ids):
    busy = {f"sha256:{i:064x}" for i in busy_ids}
    out = evictions(es, max_bytes, busy)
    assert not {e.digest for e in out} & busy
    kept = [e for e in es if e not in out]
    # Either the rest fits, or everything evictable went.
    assert (sum(e.size_bytes for e in kept) <= max_bytes
            or all(e.digest in busy for e in kept))
    # Nothing kept (and evictable) was used less recently than something evicted... unless
    # the bound was already met when it came up.
    if out:
        newest_out = max(e.last_used for e in out)
        assert all(e.last_used >= newest_out or e.digest in busy for e in kept)


def test_elf_interpreter_and_shebangs():
    real = os.path.realpath(sys.executable)
    with open(real, "rb") as fh:
        loader = hostexec.elf_interpreter(fh.read(4096))
    assert loader is not None and os.path.exists(loader)
    assert hostexec.elf_interpreter(b"#!/bin/sh\n" + bytes(100)) is None
    assert hostexec.shebang(b"#!/usr/bin/env node\nx") == ["/usr/bin/env", "node"]
    # A script for an interpreter through env runs that interpreter, through the host loader.
    heads = {"/opt/h/cli.js": b"#!/usr/bin/env node\n", "/opt/n/node": open(real, "rb").read(4096)}
    argv = hostexec.wrap(["cli", "-p"], {"cli": "/opt/h/cli.js", "node": "/opt/n/node"}.get,
                         heads.__getitem__)
    assert argv[1:4] == ["--inhibit-cache", "--library-path", hostexec.library_path(loader)]
    assert argv[4:] == ["/opt/n/node", "/opt/h/cli.js", "-p"]
    assert argv[0] == hostexec.inside(loader)
    wrapped = hostexec.wrap([sys.executable, "-c", "pass"])
    assert wrapped[0].startswith("/run/rolltap/host/") and wrapped[1] == "--inhibit-cache"
    assert wrapped[4:] == [sys.executable, "-c", "pass"]


def test_program_not_on_the_host_names_the_fix():
    with pytest.raises(hostexec.HostProgramError, match="install it in the image"):
        hostexec.wrap(["no-such-harness-xyz"])


# ---- real images ----------------------------------------------------------------------------

def task(tmp: Path, *, image: str | None = None, dockerfile: str | None = None,
         test: str) -> Task:
    """A task whose agent writes `answer.txt` and whose hidden test is `test`."""
    tests = tmp / "hidden" / "tests_hidden"
    tests.mkdir(parents=True, exist_ok=True)
    (tests / "test_image.py").write_text(textwrap.dedent(test))
    line = {"id": "img", "prompt": "p", "files": {"start.txt": "x"},
            "verifier": {"files_dir": "hidden", "command": VERIFY},
            "timeouts": {"agent_s": 60, "verifier_s": 60}}
    if image is not None:
        line["image"] = image
    if dockerfile is not None:
        line["dockerfile_dir"] = dockerfile
    (tmp / "tasks.jsonl").write_text(json.dumps(line) + "\n")
    return load_tasks(tmp / "tasks.jsonl")[0]


def explain(result) -> str:
    parts = [result.reward_detail]
    for outcome in (result.setup, result.agent):
        if outcome is not None:
            parts.append(outcome.stderr[-2000:])
    if result.verifier is not None:
        parts.append(result.verifier.output[-2000:])
    return "\n".join(parts)


def agent(script: str) -> Harness:
    return Harness(preset="command", model="m",
                   command=f"python -c {json.dumps(textwrap.dedent(script))}")


MARKER_TEST = f"""
    import os, pathlib
    def test_sees_the_image_not_the_host():
        assert "rolltap base image" in pathlib.Path("/etc/rolltap-base").read_text()
        assert not os.path.exists("{HOST_ONLY}")
        assert pathlib.Path("answer.txt").read_text() == "42"
"""
WRITE_ANSWER = "open('answer.txt', 'w').write('42')"


@needs_root
async def test_base_image_task_sees_its_marker_not_the_host(base_image, tmp_path):
    assert os.path.exists(HOST_ONLY)
    t = task(tmp_path, image=base_image, test=MARKER_TEST)
    result = await LocalBackend().run(SandboxRequest(t, agent(WRITE_ANSWER), ACCESS))
    assert (result.status, result.reward) == ("ok", 1.0), explain(result)


@needs_root
async def test_dockerfile_task_sees_copied_file_and_run_step(base_image, tmp_path):
    ctx = tmp_path / "env"
    ctx.mkdir()
    (ctx / "data.txt").write_text("from the context\n")
    (ctx / "Dockerfile").write_text(f"FROM {base_image}\nCOPY data.txt /opt/data.txt\n"
                                    "RUN echo built-by-run > /opt/step.txt\n")
    t = task(tmp_path, dockerfile="env", test="""
        import pathlib
        def test_both_steps():
            assert pathlib.Path("/opt/data.txt").read_text() == "from the context\\n"
            assert pathlib.Path("/opt/step.txt").read_text() == "built-by-run\\n"
            assert pathlib.Path("/etc/rolltap-base").exists()
    """)
    assert t.build is not None and str(ctx) in t.source_paths
    result = await LocalBackend().run(SandboxRequest(t, agent(WRITE_ANSWER), ACCESS))
    assert (result.status, result.reward) == ("ok", 1.0), explain(result)
    assert images.inspect(t.build.tag) is not None  # cached by its context's digest


@needs_root
async def test_two_sandboxes_of_one_image_see_none_of_each_others_writes(base_image, tmp_path):
    script = ("import os, pathlib, time; mine = pathlib.Path('/var/tmp/mark-' + "
              "os.urandom(8).hex()); mine.write_text('x'); time.sleep(2); "
              "open('answer.txt', 'w').write(str(len([p for p in "
              "pathlib.Path('/var/tmp').iterdir() if p != mine])))")
    t = task(tmp_path, image=base_image, test="""
        import pathlib
        def test_alone():
            assert pathlib.Path("answer.txt").read_text() == "0"
            # The verifier's overlay is its own: the agent's write is not there either.
            assert list(pathlib.Path("/var/tmp").iterdir()) == []
    """)
    backend = LocalBackend()
    a, b = await asyncio.gather(*(backend.run(SandboxRequest(t, agent(script), ACCESS))
                                  for _ in range(2)))
    for r in (a, b):
        assert (r.status, r.reward) == ("ok", 1.0), explain(r)
    digest = images.inspect(base_image).digest
    rootfs = images.Cache().rootfs(digest)
    assert os.listdir(os.path.join(rootfs, "var", "tmp")) == []


@needs_root
async def test_missing_image_without_network_is_unscorable(tmp_path):
    t = task(tmp_path, image="localhost/rolltap-no-such-image:none", test=MARKER_TEST)
    result = await LocalBackend().run(SandboxRequest(t, agent(WRITE_ANSWER), ACCESS))
    assert (result.status, result.reward, result.gateway_status) == (
        "setup_failed", None, "failed")
    assert "not in this machine's containers-storage" in result.reward_detail
    assert "rolltap image prepare" in result.reward_detail
    assert result.agent is None  # nothing ran


# ---- the cache ------------------------------------------------------------------------------


def fake_entry(cache: images.Cache, n: int, size: int, used: float) -> Entry:
    entry = Entry(f"sha256:{n:064x}", f"img{n}", size)
    where = Path(cache.path, images.entry_name(entry.digest))
    (where / "rootfs").mkdir(parents=True)
    meta = where / "entry.json"
    meta.write_bytes(json.dumps({"digest": entry.digest, "ref": entry.ref,
                                 "size_bytes": size}).encode())
    os.utime(meta, (used, used))
    return entry


def test_prune_removes_least_recently_used_but_not_what_is_in_use(tmp_path):
    cache = images.Cache(images.CacheConfig(str(tmp_path / "cache"), 1))
    old, busy, new = (fake_entry(cache, i, 100, t) for i, t in ((1, 10), (2, 20), (3, 30)))
    fd = cache._lock(busy.digest)
    fcntl.flock(fd, fcntl.LOCK_SH)  # a sandbox on it
    try:
        removed = cache.prune(150)
    finally:
        os.close(fd)
    assert [e.ref for e in removed] == ["img1"]  # img2 is busy; img1+img2 out would do
    assert sorted(e.ref for e in cache.entries()) == ["img2", "img3"]
    assert [e.ref for e in cache.prune(0)] == ["img2", "img3"]


@needs_root
def test_short_disk_is_a_clear_error(base_image, tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    assert disk.bound(str(small), 8) is None
    try:
        cache = images.Cache(images.CacheConfig(str(small), 1000))
        with pytest.raises(images.ImageError, match="not enough disk .* MB free"):
            with images.rootfs_for(base_image, cache=cache):
                pass
    finally:
        disk.release(str(small))


def test_cli_help_names_every_action(capsys):
    import argparse

    from sandbox import image_cli
    parser = argparse.ArgumentParser(prog="rolltap")
    image_cli.register(parser.add_subparsers(dest="command"))
    with pytest.raises(SystemExit):
        parser.parse_args(["image", "--help"])
    out = capsys.readouterr().out
    assert all(word in out for word in ("base", "prepare", "list", "prune"))


def test_bad_cache_bound_says_what_to_set():
    with pytest.raises(images.ImageError, match="ROLLTAP_IMAGE_CACHE_MB"):
        images.CacheConfig.from_env({"ROLLTAP_IMAGE_CACHE_MB": "lots"})


# ---- the confinement seam (pure planning) ---------------------------------------------------

dests = st.lists(st.lists(st.sampled_from(["a", "b c", "d"]), min_size=1, max_size=3).map(
    lambda parts: "/" + "/".join(parts)), min_size=1, max_size=4, unique=True)


@given(dests, st.booleans())
def test_image_stage_makes_every_mount_point_reachable(paths, dirs):
    binds = tuple(Bind(f"/host{p}", p) for p in paths)
    image = Image("/cache/sha256-x/rootfs", "/area/.overlay")
    phase = Phase(View(binds=binds, image=image), 2_000_000_001, "/sandbox/work", ("true",))
    points = confine.mount_points(phase, lambda source: dirs)
    assert {p for p, _ in points} >= {*paths, confine.RUN_DIR}
    staged = confine.stage_plan(phase)
    script = confine.stage_script(image, staged, points)
    # The overlay's lower layer is the cached root, its upper the area's: never the reverse.
    assert (f"-o nodev,nosuid,lowerdir={staged[image.rootfs]},"
            f"upperdir={staged[image.overlay]}/upper," in script)
    lines = script.splitlines()
    for path in paths:
        chain, parent = [path], os.path.dirname(path)
        while parent != "/":
            chain.insert(0, parent)
            parent = os.path.dirname(parent)
        # Every component is checked for a link before anything is made through it.
        check = "no_links " + " ".join(shlex.quote(confine.STAGED_ROOT + p) for p in chain)
        where = shlex.quote(confine.STAGED_ROOT + path)
        made = next(i for i, line in enumerate(lines)
                    if line == f"mkdir -p {where}" or line.endswith(f"|| : > {where}"))
        assert lines[made - 1] == check
        parent = os.path.dirname(path)
        while parent != "/":
            assert f"chmod o+x {shlex.quote(confine.STAGED_ROOT + parent)}" in script
            parent = os.path.dirname(parent)
    assert script.rstrip().endswith('exec "$@"')


def test_image_command_line_roots_the_sandbox_in_the_overlay():
    image = Image("/cache/sha256-x/rootfs", "/area/.overlay")
    phase = Phase(View(binds=(Bind("/area/work", "/sandbox/work", True),), image=image),
                  2_000_000_001, "/sandbox/work", ("true",))
    staged = confine.stage_plan(phase)
    system = confine.system_args({"usr": None, "bin": "usr/bin"}, confine.HOST_ROOT)
    args = confine.inner_args(phase, system=system, staged=staged)
    at = args.index("--bind")
    assert args[at:at + 5] == ["--bind", confine.STAGED_ROOT, "/", "--tmpfs", confine.RUN_DIR]
    assert ["--ro-bind", "/usr", f"{confine.HOST_ROOT}/usr"] == args[at + 5:at + 8]
    # The root stays the writable overlay; rolltap's own directory is made read-only.
    assert "/" not in [args[i + 1] for i, a in enumerate(args) if a == "--remount-ro"]
    assert args[args.index("--remount-ro") + 1] == confine.RUN_DIR
    outer = confine.outer_args(phase, staged, {image.overlay}, image_step=["sh", "-c", "x"])
    assert "CAP_SYS_ADMIN" in outer and outer[-8:-5] == ["sh", "-c", "x"]
    assert "CAP_SYS_ADMIN" not in confine.outer_args(phase, staged, set())


@needs_root
async def test_image_without_confinement_is_refused_clearly(tmp_path):
    t = task(tmp_path, image="localhost/whatever:1", test=MARKER_TEST)
    result = await LocalBackend(isolation="none").run(SandboxRequest(t, agent(WRITE_ANSWER),
                                                                     ACCESS))
    assert (result.status, result.reward) == ("setup_failed", None)
    assert "--isolation bwrap" in result.reward_detail


@needs_root
async def test_image_links_cannot_lead_the_root_stage_out(base_image, tmp_path):
    """An image with a link where rolltap mounts (/sandbox -> a host path): the root stage
    refuses it instead of making directories through it on the host."""
    # An existing host directory outside /tmp (which the stage covers with a tmpfs of its
    # own); a fixed name, so that the image is built once.
    escape = Path("/var/tmp/rolltap-test-image-escape")
    escape.mkdir(exist_ok=True)
    ctx = tmp_path / "env"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text(f"FROM {base_image}\nRUN ln -s {escape} /sandbox\n")
    t = task(tmp_path, dockerfile="env", test=MARKER_TEST)
    try:
        result = await LocalBackend().run(SandboxRequest(t, agent(WRITE_ANSWER), ACCESS))
        assert list(escape.iterdir()) == []
    finally:
        shutil.rmtree(escape, ignore_errors=True)
    assert result.reward != 1.0
    assert "symbolic link at /sandbox" in (result.agent.stderr if result.agent else ""), \
        explain(result)


@pytest.fixture(scope="session")
def tiny_image(tmp_path_factory) -> str:
    """A one-file image (buildah from scratch), for tests of the cache alone."""
    if os.geteuid() != 0:
        pytest.skip("buildah's store needs root here")
    ref = "localhost/rolltap-test-tiny:1"
    if images.inspect(ref) is None:
        ctx = tmp_path_factory.mktemp("tiny")
        (ctx / "hello.txt").write_text("hello\n")
        (ctx / "Dockerfile").write_text("FROM scratch\nCOPY hello.txt /hello.txt\n")
        subprocess.run(["buildah", "bud", "--quiet", "-t", ref, str(ctx)], check=True,
                       capture_output=True)
    return ref


def test_first_uses_at_once_unpack_once_and_wait_only_for_the_unpack(tiny_image, tmp_path):
    """Two sandboxes meet an image at once: one unpacks, the other waits for that alone, not
    for the first sandbox to end."""
    cache = images.Cache(images.CacheConfig(str(tmp_path / "cache")))
    unpack = cache._unpack

    def slow_unpack(ref, image):  # the other sandbox arrives while this one unpacks
        time.sleep(0.5)
        unpack(ref, image)

    cache._unpack = slow_unpack
    got: list[str] = []
    both = threading.Barrier(2)
    released = threading.Event()

    def sandbox() -> None:
        both.wait()
        with images.rootfs_for(tiny_image, cache=cache) as path:
            got.append(Path(path, "hello.txt").read_text())
            released.wait(30)  # a long sandbox on it

    threads = [threading.Thread(target=sandbox) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 20
        while len(got) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert got == ["hello\n", "hello\n"]
    finally:
        released.set()
        for t in threads:
            t.join()
    assert [e.ref for e in cache.entries()] == [tiny_image]


@pytest.mark.parametrize(("dockerfile", "refs"), [
    ("FROM debian:bookworm-slim\nRUN true\n", ["debian:bookworm-slim"]),
    ("FROM --platform=linux/amd64 a/b:1 AS build\nFROM build\nFROM scratch\nFROM c\n",
     ["a/b:1", "c"]),
])
def test_a_dockerfiles_base_images_are_its_froms_but_its_own_stages(dockerfile, refs):
    assert images.base_refs(dockerfile) == refs


def test_short_names_qualify_as_docker_resolves_them():
    assert images.qualified("debian:bookworm-slim") == "docker.io/library/debian:bookworm-slim"
    assert images.qualified("user/app:1") == "docker.io/user/app:1"
    assert images.qualified("localhost/x:1") == "localhost/x:1"
    assert images.qualified("quay.io/a/b") == "quay.io/a/b"


def test_a_missing_base_image_says_in_one_line_what_to_run(tmp_path):
    """Offline, a Dockerfile FROM an image this machine does not have: one line naming the
    image and the commands that get it (issue 38)."""
    (tmp_path / "Dockerfile").write_text("FROM localhost/rolltap-missing-base:none\nRUN true\n")
    with pytest.raises(images.ImageError) as info:
        images.build(images.load_build(str(tmp_path)))
    message = str(info.value)
    assert "\n" not in message
    assert "base image localhost/rolltap-missing-base:none is not on this machine" in message
    assert "rolltap image base --tag localhost/rolltap-missing-base:none" in message
