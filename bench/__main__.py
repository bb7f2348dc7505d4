"""`make bench`: every benchmark section in one run: each `bench/bench_*.py` with
`run(print_fn)`, then each `bench/peer_*.py` (another project's proxy measured against rolltap's).

A section that fails does not stop the others; the run exits non-zero if any failed.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import sys
import time
import traceback
from pathlib import Path


def sections() -> list[str]:
    here = str(Path(__file__).resolve().parent)
    modules = [m.name for m in pkgutil.iter_modules([here]) if not m.ispkg]
    return [
        f"bench.{name}"
        for prefix in ("bench_", "peer_")
        for name in sorted(modules)
        if name.startswith(prefix)
    ]


def short(name: str) -> str:
    """What names a section on the command line: `gateway` for bench.bench_gateway,
    `peer_openenv` for bench.peer_openenv."""
    return name.removeprefix("bench.").removeprefix("bench_")


def main(argv: list[str]) -> int:
    """Runs the sections named in `argv` (e.g. `gateway` for bench_gateway), or all of them;
    `--quick`: the sections that can, in a shorter mode."""
    if "--quick" in argv:  # read by the sections that have a shorter mode (bench_floors)
        os.environ["ROLLTAP_BENCH_QUICK"] = "1"
        argv = [a for a in argv if a != "--quick"]
    names = sections()
    if argv:
        wanted = {a.removeprefix("bench_").removesuffix(".py") for a in argv}
        names = [n for n in names if short(n) in wanted]
    failed: list[str] = []
    timings: list[tuple[str, float]] = []
    for name in names:
        print(f"\n=== {name} ===", flush=True)
        started = time.monotonic()
        try:
            importlib.import_module(name).run(print_fn=lambda *a: print(*a, flush=True))
        except Exception:  # noqa: BLE001 - one broken section must not hide the others' numbers
            traceback.print_exc()
            failed.append(name)
        timings.append((name, time.monotonic() - started))
    print("\n=== sections ===")
    for name, seconds in timings:
        print(f"{name:<32}{seconds:7.1f} s   {'FAILED' if name in failed else 'ok'}")
    return 1 if failed or not names else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
