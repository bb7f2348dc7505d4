"""`rolltap image`: make the registry-free base image, pre-pull or pre-build the images of a
task set, and list or prune the cache of unpacked images (sandbox/images.py)."""

from __future__ import annotations

import argparse
import sys
import time

EPILOG = """examples:
  rolltap image base                       # Debian bookworm + python3 + pytest, from Debian's
                                           # packages, as localhost/rolltap-base:bookworm
  rolltap image prepare --tasks tasks.jsonl   # on each node: pull/build and unpack every image
  rolltap image prepare docker.io/library/python:3.12-slim
  rolltap image list
  rolltap image prune --max-mb 5000

The cache is ROLLTAP_IMAGE_CACHE (default .cache/images in the repository), bounded by
ROLLTAP_IMAGE_CACHE_MB (default 20000); least recently used images go first."""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "image", help="task images: base image, pre-pull/pre-build, list and prune the cache",
        description=__doc__, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="image_command", metavar="ACTION", required=True)

    base = sub.add_parser("base", help="make a Debian base image from Debian's packages "
                          "(mmdebstrap) and commit it into containers-storage")
    base.add_argument("--tag", default=None, help="image name (default "
                      "localhost/rolltap-base:bookworm)")
    base.add_argument("--suite", default=None, help="Debian suite (default bookworm)")
    base.add_argument("--include", action="append", default=None, metavar="PACKAGE",
                      help="a Debian package to install; repeat (default python3, "
                      "python3-pytest, python-is-python3)")
    base.add_argument("--keep", default=None, metavar="TARBALL",
                      help="keep mmdebstrap's root filesystem here, and build from it without "
                      "the mirror when it is already there (offline rebuilds)")
    base.add_argument("--mirror", default=None, help="Debian mirror URL (default: the "
                      "machine's apt sources)")
    base.set_defaults(func=_base)

    prep = sub.add_parser("prepare", help="pull or build, then unpack, images ahead of a run "
                          "(each node of a cluster)")
    prep.add_argument("refs", nargs="*", metavar="IMAGE", help="image references")
    prep.add_argument("--tasks", action="append", default=[], metavar="TASKS.jsonl",
                      help="every image and Dockerfile of this task file; repeat")
    prep.set_defaults(func=_prepare)

    ls = sub.add_parser("list", help="the unpacked images, most recently used first")
    ls.set_defaults(func=_list)

    prune = sub.add_parser("prune", help="remove least recently used unpacked images")
    prune.add_argument("--max-mb", type=int, default=0,
                       help="keep at most this many MB (default 0: remove all not in use)")
    prune.set_defaults(func=_prune)


def _base(args: argparse.Namespace) -> int:
    from sandbox import images
    started = time.monotonic()
    print("building the base image with mmdebstrap (about half a minute)...", file=sys.stderr)
    digest = images.base_image(args.tag or images.BASE_TAG, args.suite or images.BASE_SUITE,
                               args.include or images.BASE_PACKAGES, args.mirror, args.keep)
    print(f"{args.tag or images.BASE_TAG} {digest} "
          f"({time.monotonic() - started:.1f} s)")
    return 0


def _prepare(args: argparse.Namespace) -> int:
    from sandbox import images
    from sandbox.tasks import load_tasks
    wanted: dict[str, tuple[str | None, images.Build | None]] = {
        ref: (ref, None) for ref in args.refs}
    for path in args.tasks:
        for task in load_tasks(path):
            key = task.build.tag if task.build else task.image
            if key is not None:
                wanted[key] = (task.image, task.build)
    if not wanted:
        print("no images named", file=sys.stderr)
        return 2
    cache = images.Cache()
    failed = 0
    for n, (name, (ref, build)) in enumerate(wanted.items(), 1):
        started = time.monotonic()
        try:
            with images.rootfs_for(ref, build, cache) as path:
                print(f"[{n}/{len(wanted)}] {name}: {path} "
                      f"({time.monotonic() - started:.1f} s)")
        except images.ImageError as exc:
            failed += 1
            print(f"[{n}/{len(wanted)}] {name}: {exc}", file=sys.stderr)
    return 1 if failed else 0


def _list(args: argparse.Namespace) -> int:
    from sandbox import images
    cache = images.Cache()
    entries = sorted(cache.entries(), key=lambda e: -e.last_used)
    for e in entries:
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(e.last_used))
        print(f"{e.size_bytes / images.MB:9.0f} MB  {used}  {e.digest[:19]}  {e.ref}")
    total = sum(e.size_bytes for e in entries) / images.MB
    print(f"{len(entries)} images, {total:.0f} MB of {cache.config.max_mb} MB in {cache.path}")
    return 0


def _prune(args: argparse.Namespace) -> int:
    from sandbox import images
    cache = images.Cache()
    removed = cache.prune(max(args.max_mb, 0) * images.MB)
    for e in removed:
        print(f"removed {e.ref} ({e.size_bytes / images.MB:.0f} MB)")
    print(f"{len(removed)} removed; {len(cache.entries())} left")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="rolltap")
    register(parser.add_subparsers(dest="command", required=True))
    parsed = parser.parse_args(["image", *sys.argv[1:]])
    sys.exit(parsed.func(parsed))
