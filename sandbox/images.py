"""Task images: a task's own root filesystem, from the machine's containers-storage.

An image is named by reference (`image` in a task) or built from a Dockerfile directory (its
build context). Only the standard daemonless tools touch images:
- skopeo looks a reference up in containers-storage (the store podman, buildah and skopeo
  share) and, when it is missing, pulls it from its registry into that store;
- buildah builds a Dockerfile (`buildah bud`, chroot isolation: no OCI runtime or daemon
  needed), tagged by the digest of its build context, so an unchanged context is never built
  twice and a node where the tag was pre-built needs no context at all;
- mmdebstrap makes a Debian base image from Debian's packages and buildah commits it into
  the store (`base_image`): tasks can be `FROM` it without any registry.

Each image is unpacked once into a content-addressed cache (by the image's manifest digest):
skopeo copies it to an OCI layout and `umoci raw unpack` applies its layers (whiteouts,
ownership, modes). That gives a plain directory that outlives the store's own overlay mounts
and needs no container object held open, unlike `buildah mount`. Sandboxes never write to it:
each phase mounts it read-only under an overlay of its own (confine.py).

The cache is bounded (least recently used entries go first; one in use by a sandbox, which
holds a shared lock on it, is never removed), listed and pruned by `rolltap image`, and an
unpack that would not fit on the disk stops with an error saying what to free.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import shutil
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from pathlib import Path

import msgspec

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CACHE = REPO_ROOT / ".cache" / "images"
DEFAULT_MAX_MB = 20_000
BUILD_REPO = "localhost/rolltap-build"
BASE_TAG = "localhost/rolltap-base:bookworm"
BASE_SUITE = "bookworm"
# What the base image holds besides Debian's minimal system: enough to run pytest verifiers.
BASE_PACKAGES = ("python3", "python3-pytest", "python-is-python3")
# The base image names itself here, so a test can tell it from the host.
BASE_MARKER = "etc/rolltap-base"
# An unpack needs the OCI copy and the root filesystem at once, the latter larger than the
# compressed layers: room asked for beyond the image's layer sizes, as a factor and a margin.
UNPACK_FACTOR = 4
UNPACK_MARGIN_MB = 64
PULL_TIMEOUT_S = 600.0
BUILD_TIMEOUT_S = 3600.0
TOOL_TIMEOUT_S = 120.0
MB = 1 << 20


class ImageError(RuntimeError):
    """An image that cannot be had: the message says what to do."""


class Build(msgspec.Struct, frozen=True):
    """A Dockerfile image: its build context on the machine that loaded the task, and that
    context's digest (which names the image on every machine)."""

    context: str
    digest: str

    @property
    def tag(self) -> str:
        return build_tag(self.digest)


class Entry(msgspec.Struct, frozen=True):
    """One unpacked image in the cache."""

    digest: str
    ref: str
    size_bytes: int
    last_used: float = 0.0


class CacheConfig(msgspec.Struct, frozen=True):
    """Where unpacked images live and how much of the disk they may take."""

    path: str = str(DEFAULT_CACHE)
    max_mb: int = DEFAULT_MAX_MB

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> CacheConfig:
        """ROLLTAP_IMAGE_CACHE (a directory) and ROLLTAP_IMAGE_CACHE_MB (its bound)."""
        raw = environ.get("ROLLTAP_IMAGE_CACHE_MB")
        if raw is not None and not (raw.isdigit() and int(raw) > 0):
            raise ImageError(f"ROLLTAP_IMAGE_CACHE_MB must be a positive number of MB, "
                             f"not {raw!r}")
        return cls(environ.get("ROLLTAP_IMAGE_CACHE", str(DEFAULT_CACHE)),
                   int(raw) if raw else DEFAULT_MAX_MB)


# ---- pure -----------------------------------------------------------------------------------


def context_digest(files: Mapping[str, tuple[int, bytes]]) -> str:
    """The digest of a build context: every file's relative path, mode and content."""
    h = hashlib.sha256()
    for name in sorted(files):
        mode, data = files[name]
        h.update(f"{len(name)}:{name}:{mode:o}:{len(data)}:".encode())
        h.update(data)
    return h.hexdigest()


def build_tag(digest: str) -> str:
    return f"{BUILD_REPO}:{digest[:24]}"


def entry_name(digest: str) -> str:
    """The cache directory of an image digest (`sha256:...` has a colon, unwelcome in paths
    that end up in mount options)."""
    algo, _, hexpart = digest.partition(":")
    if not hexpart or not algo.isalnum() or not all(c in "0123456789abcdef" for c in hexpart):
        raise ValueError(f"not an image digest: {digest!r}")
    return f"{algo}-{hexpart}"


def evictions(entries: Sequence[Entry], max_bytes: int, busy: set[str]) -> list[Entry]:
    """The entries to remove, least recently used first, so that the rest fit in `max_bytes`;
    busy entries (in use by a sandbox) are never among them."""
    total = sum(e.size_bytes for e in entries)
    out = []
    for entry in sorted(entries, key=lambda e: (e.last_used, e.digest)):
        if total <= max_bytes:
            break
        if entry.digest in busy:
            continue
        out.append(entry)
        total -= entry.size_bytes
    return out


def needed_bytes(layer_sizes: Sequence[int]) -> int:
    return UNPACK_FACTOR * sum(layer_sizes) + UNPACK_MARGIN_MB * MB


def short_disk_message(path: str, free: int, need: int, ref: str) -> str:
    return (f"not enough disk to unpack {ref} into {path}: {free // MB} MB free, about "
            f"{need // MB} MB needed. Free space, prune the cache (`rolltap image prune "
            f"--max-mb N`), or point ROLLTAP_IMAGE_CACHE at a larger disk.")


# ---- the tools ------------------------------------------------------------------------------


def _tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        raise ImageError(f"{name} is not installed; task images need it. Install the Debian "
                         f"packages: apt-get install -y mmdebstrap buildah skopeo umoci "
                         f"(`make deps` does, as root)")
    return found


def _run(argv: list[str], what: str, timeout_s: float = TOOL_TIMEOUT_S,
         **kwargs) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, **kwargs)
    except subprocess.TimeoutExpired:
        raise ImageError(f"{what}: {argv[0]} took more than {timeout_s:.0f} s") from None
    if proc.returncode != 0:
        raise ImageError(f"{what}: {_last_lines(proc.stderr)}")
    return proc


def _last_lines(text: str, n: int = 5) -> str:
    lines = [ln for ln in text.strip().splitlines() if "level=info" not in ln]
    return " / ".join(lines[-n:]) or "(no output)"


class Inspected(msgspec.Struct, frozen=True):
    digest: str
    layer_sizes: tuple[int, ...]


class _Layer(msgspec.Struct):
    Size: int = 0


class _Inspect(msgspec.Struct):
    Digest: str
    LayersData: list[_Layer] | None = None


def inspect(ref: str) -> Inspected | None:
    """The image `ref` in the local containers-storage, or None if it is not there."""
    proc = subprocess.run([_tool("skopeo"), "inspect", f"containers-storage:{ref}"],
                          capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
    if proc.returncode != 0:
        return None
    info = msgspec.json.decode(proc.stdout, type=_Inspect)
    return Inspected(info.Digest, tuple(layer.Size for layer in info.LayersData or ()))


def pull(ref: str) -> Inspected:
    """Copy `ref` from its registry into containers-storage."""
    try:
        _run([_tool("skopeo"), "copy", "--retry-times", "0", f"docker://{ref}",
              f"containers-storage:{ref}"], f"pulling {ref}", PULL_TIMEOUT_S)
    except ImageError as exc:
        raise ImageError(
            f"image {ref} is not in this machine's containers-storage and could not be pulled "
            f"({exc}). Pull or build it on this machine first (`rolltap image prepare {ref}`, "
            f"`skopeo copy docker://{ref} containers-storage:{ref}`, or `podman pull`)") from None
    found = inspect(ref)
    if found is None:
        raise ImageError(f"skopeo pulled {ref} but containers-storage does not list it")
    return found


def base_refs(dockerfile: str) -> list[str]:
    """The images a Dockerfile's stages start FROM, other than its own stages and scratch.
    Pure."""
    refs, stages = [], set()
    for line in dockerfile.splitlines():
        words = line.split()
        if len(words) < 2 or words[0].upper() != "FROM":
            continue
        args = [w for w in words[1:] if not w.startswith("--")]
        if args and args[0] not in stages and args[0] != "scratch":
            refs.append(args[0])
        if len(args) >= 3 and args[1].upper() == "AS":
            stages.add(args[2])
    return refs


def qualified(ref: str) -> str:
    """A short image name as Docker resolves it (debian:bookworm-slim ->
    docker.io/library/debian:bookworm-slim). Pure."""
    first, _, rest = ref.partition("/")
    if not rest:
        return f"docker.io/library/{ref}"
    if "." not in first and ":" not in first and first != "localhost":
        return f"docker.io/{ref}"
    return ref


def missing_base_message(ref: str) -> str:
    full = qualified(ref)
    return (f"the Dockerfile's base image {ref} is not on this machine (builds never pull): "
            f"pull it (`skopeo copy docker://{full} containers-storage:{full}`), tag a local "
            f"image as it (`podman tag IMAGE {full}`), or make a Debian one offline "
            f"(`rolltap image base --tag {full}`)")


def read_context(directory: str) -> dict[str, tuple[int, bytes]]:
    """The regular files of a build context (relative path -> (mode, content))."""
    root = Path(directory)
    if not (root / "Dockerfile").is_file():
        raise ImageError(f"{directory} has no Dockerfile")
    files = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in filenames:
            full = Path(dirpath, name)
            st = full.lstat()
            rel = full.relative_to(root).as_posix()
            files[rel] = (stat.S_IMODE(st.st_mode),
                          os.readlink(full).encode() if full.is_symlink() else full.read_bytes())
    return files


def load_build(directory: str) -> Build:
    context = os.path.realpath(directory)
    return Build(context, context_digest(read_context(context)))


def build(spec: Build) -> Inspected:
    """The Dockerfile image of `spec`, built with buildah unless its tag is already stored."""
    found = inspect(spec.tag)
    if found is not None:
        return found
    if not os.path.isdir(spec.context):
        raise ImageError(f"the Dockerfile image {spec.tag} is not built on this machine and "
                         f"its build context {spec.context} is not here; build it on every "
                         f"node first (`rolltap image prepare --tasks TASKS.jsonl`)")
    if load_build(spec.context).digest != spec.digest:
        raise ImageError(f"the build context {spec.context} changed since the task was loaded; "
                         f"load the tasks again")
    # chroot isolation: RUN steps need no OCI runtime (crun fails on hybrid cgroups here).
    try:
        _run([_tool("buildah"), "bud", "--quiet", "--isolation", "chroot", "--pull-never",
              "-t", spec.tag, spec.context], f"building {spec.context}/Dockerfile",
             BUILD_TIMEOUT_S)
    except ImageError as exc:
        missing = [ref for ref in base_refs(Path(spec.context, "Dockerfile").read_text())
                   if ref in str(exc) and "image not known" in str(exc)]
        if missing:
            raise ImageError(missing_base_message(missing[0])) from None
        raise
    found = inspect(spec.tag)
    if found is None:
        raise ImageError(f"buildah built {spec.tag} but containers-storage does not list it")
    return found


def locate(ref: str | None = None, dockerfile: Build | None = None) -> tuple[str, Inspected]:
    """(reference, image) for a task's image: built, found locally, or pulled."""
    if dockerfile is not None:
        return dockerfile.tag, build(dockerfile)
    if ref is None:
        raise ValueError("an image reference or a Dockerfile is needed")
    return ref, inspect(ref) or pull(ref)


def base_image(tag: str = BASE_TAG, suite: str = BASE_SUITE,
               packages: Sequence[str] = BASE_PACKAGES, mirror: str | None = None,
               keep: str | None = None) -> str:
    """A minimal Debian image made from Debian's packages with mmdebstrap and committed into
    containers-storage as `tag` by buildah; no registry involved. With `keep`, mmdebstrap's
    root filesystem tarball is kept at that path and used instead of the mirror when it is
    there already (an offline rebuild). Returns the image's digest."""
    with tempfile.TemporaryDirectory(prefix="rolltap-base-") as tmp:
        tarball = keep or os.path.join(tmp, "rootfs.tar")
        if not os.path.isfile(tarball):
            marker = f"rolltap base image: Debian {suite} ({', '.join(packages)})"
            partial = os.path.join(tmp, "partial.tar")
            argv = [_tool("mmdebstrap"), "--variant=minbase", "--quiet",
                    f"--include={','.join(packages)}",
                    f"--customize-hook=echo '{marker}' > \"$1/{BASE_MARKER}\"", suite, partial]
            _run([*argv, *([mirror] if mirror else [])], f"mmdebstrap {suite}",
                 BUILD_TIMEOUT_S)
            os.makedirs(os.path.dirname(os.path.abspath(tarball)), exist_ok=True)
            shutil.move(partial, tarball)
        buildah = _tool("buildah")
        container = _run([buildah, "from", "scratch"], "buildah from scratch").stdout.strip()
        try:
            _run([buildah, "add", "--quiet", container, tarball, "/"], "buildah add")
            _run([buildah, "config", "--env",
                  "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                  "--cmd", "/bin/sh", container], "buildah config")
            _run([buildah, "commit", "--quiet", container, tag], "buildah commit")
        finally:
            subprocess.run([buildah, "rm", container], capture_output=True)
    found = inspect(tag)
    assert found is not None
    return found.digest


# ---- the cache ------------------------------------------------------------------------------


class Cache:
    """Unpacked images under `config.path`: `<name>/rootfs`, `<name>/entry.json` (whose
    mtime is the last use), `<name>.lock` (shared while a sandbox uses it, exclusive while
    it is removed), `<name>.unpack` (held while it is unpacked)."""

    def __init__(self, config: CacheConfig | None = None) -> None:
        self.config = config or CacheConfig.from_env()
        self.path = self.config.path
        os.makedirs(self.path, mode=0o755, exist_ok=True)

    def _lock(self, digest: str, kind: str = "lock") -> int:
        return os.open(os.path.join(self.path, f"{entry_name(digest)}.{kind}"),
                       os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def entries(self) -> list[Entry]:
        out = []
        for name in sorted(os.listdir(self.path)):
            meta = os.path.join(self.path, name, "entry.json")
            if name.startswith(".") or not os.path.isfile(meta):
                continue  # a lock, an unpack or a removal under way
            with contextlib.suppress(FileNotFoundError, msgspec.DecodeError):
                with open(meta, "rb") as fh:
                    entry = msgspec.json.decode(fh.read(), type=Entry)
                out.append(msgspec.structs.replace(entry, last_used=os.stat(meta).st_mtime))
        return out

    def rootfs(self, digest: str) -> str:
        return os.path.join(self.path, entry_name(digest), "rootfs")

    @contextlib.contextmanager
    def use(self, ref: str, image: Inspected) -> Iterator[str]:
        """The image's root filesystem, unpacked if it is not yet, held (not evictable) for
        the duration of the block."""
        fd = self._lock(image.digest)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # from here on, prune leaves it alone
            if not os.path.isdir(self.rootfs(image.digest)):
                # One unpack at a time; the others wait for it, then find it there.
                unpacking = self._lock(image.digest, "unpack")
                try:
                    fcntl.flock(unpacking, fcntl.LOCK_EX)
                    if not os.path.isdir(self.rootfs(image.digest)):
                        self._unpack(ref, image)
                finally:
                    os.close(unpacking)
            os.utime(os.path.join(self.path, entry_name(image.digest), "entry.json"))
            yield self.rootfs(image.digest)
        finally:
            os.close(fd)

    def _unpack(self, ref: str, image: Inspected) -> None:
        need = needed_bytes(image.layer_sizes)
        self.prune(self.config.max_mb * MB - need, keep={image.digest})
        free = shutil.disk_usage(self.path).free
        if free < need:
            raise ImageError(short_disk_message(self.path, free, need, ref))
        final = os.path.join(self.path, entry_name(image.digest))
        work = tempfile.mkdtemp(prefix=".unpack-", dir=self.path)
        try:
            layout = os.path.join(work, "oci")
            # Uncompressed layers: compressing them only for umoci to uncompress them again
            # took most of a first start.
            _run([_tool("skopeo"), "copy", "--quiet", "--dest-oci-accept-uncompressed-layers",
                  f"containers-storage:{ref}", f"oci:{layout}:image"],
                 f"copying {ref} out of containers-storage", PULL_TIMEOUT_S)
            _run([_tool("umoci"), "raw", "unpack", "--image", f"{layout}:image",
                  os.path.join(work, "rootfs")], f"unpacking {ref}", PULL_TIMEOUT_S)
            shutil.rmtree(layout)
            entry = Entry(image.digest, ref, _tree_bytes(os.path.join(work, "rootfs")))
            with open(os.path.join(work, "entry.json"), "wb") as fh:
                fh.write(msgspec.json.encode(entry))
            os.chmod(work, 0o755)
            os.rename(work, final)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise ImageError(short_disk_message(self.path, 0, need, ref)) from None
            raise
        except ImageError as exc:
            if "no space left" in str(exc).lower():
                raise ImageError(short_disk_message(
                    self.path, shutil.disk_usage(self.path).free, need, ref)) from None
            raise
        finally:
            if os.path.isdir(work):
                _remove(work)

    def prune(self, max_bytes: int, keep: AbstractSet[str] = frozenset()) -> list[Entry]:
        """Remove least recently used entries until the rest fit in `max_bytes`; entries in
        use (or in `keep`) stay. Returns what was removed."""
        entries = self.entries()
        busy = set(keep)
        removed = []
        for entry in evictions(entries, max_bytes, busy):
            fd = self._lock(entry.digest)
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a sandbox runs on it
                _remove(os.path.join(self.path, entry_name(entry.digest)))
                removed.append(entry)
            finally:
                os.close(fd)
        return removed


def _tree_bytes(path: str) -> int:
    total = 0
    for dirpath, dirnames, filenames in os.walk(path):
        for name in [*dirnames, *filenames]:
            total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total


def _remove(path: str) -> None:
    # Moved aside first, so a half-removed entry is never taken for a whole one.
    doomed = f"{path}.removing-{os.getpid()}-{time.monotonic_ns()}"
    os.rename(path, doomed)
    shutil.rmtree(doomed)


@contextlib.contextmanager
def rootfs_for(ref: str | None = None, dockerfile: str | Build | None = None,
               cache: Cache | None = None) -> Iterator[str]:
    """The unpacked root filesystem of an image reference or a Dockerfile directory, held for
    the block: the entry point for sandbox backends (the Harbor environment too)."""
    build_spec = load_build(dockerfile) if isinstance(dockerfile, str) else dockerfile
    name, image = locate(ref, build_spec)
    with (cache or Cache()).use(name, image) as path:
        yield path
