"""`make bench`: every benchmark section (each `bench/bench_*.py` with `run(print_fn)`) in one run.

A section that fails does not stop the others; the run exits non-zero if any failed.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import time
import traceback
from pathlib import Path


def sections() -> list[str]:
    here = str(Path(__file__).resolve().parent)
    return sorted(
        f"bench.{m.name}"
        for m in pkgutil.iter_modules([here])
        if m.name.startswith("bench_") and not m.ispkg
    )


def main(argv: list[str]) -> int:
    """Runs the sections named in `argv` (e.g. `gateway` for bench_gateway), or all of them."""
    names = sections()
    if argv:
        wanted = {a.removeprefix("bench_").removesuffix(".py") for a in argv}
        names = [n for n in names if n.removeprefix("bench.bench_") in wanted]
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
