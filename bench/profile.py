"""Where the gateway's CPU goes under the bench's load, sampled by py-spy: what the CPU account's
counters cannot split (aiohttp's parsers, asyncpg's protocol, the loop) by function.

Starts a stand-in (512 prompt tokens, 32 sampled) and a gateway as the floors section does,
drives it with the bench's load generator and samples the gateway's Python stacks (py-spy,
`--nonblocking`, native frames off) over the measured phase. Prints the functions with the
most samples, on their own (self) and with what they call (inclusive), and writes the
collapsed stacks (flamegraph.pl's input) where `--out` says.

    python -m bench.profile --concurrency 64 --seconds 10 --out gateway.folded
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import threading
import uuid
from collections import Counter
from pathlib import Path

from bench import standin
from bench.bench_gateway import POSTGRES_URL, Gateway, LoadSpec, admin_sql, free_port, run_loadgen

TOP = 30


def collapsed(path: Path) -> Counter[str]:
    """py-spy's raw output: `frame;frame;... samples` per line, outermost frame first."""
    stacks: Counter[str] = Counter()
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if stack:
            stacks[stack] += int(n)
    return stacks


def tops(stacks: Counter[str]) -> tuple[Counter[str], Counter[str], int]:
    """(samples by leaf function, samples by any function on the stack, all samples)."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    for stack, n in stacks.items():
        frames = [f.split(" (")[0] + " " + f.rpartition("/")[2].rstrip(")") for f in
                  stack.split(";")]  # fmt: skip
        own[frames[-1]] += n
        for frame in set(frames):
            inclusive[frame] += n
    return own, inclusive, sum(stacks.values())


def report(stacks: Counter[str]) -> str:
    own, inclusive, total = tops(stacks)
    lines = [f"{total} samples"]
    for title, counts in (("self", own), ("inclusive", inclusive)):
        lines.append(f"top {TOP} by {title}:")
        lines += [f"  {n / total:6.1%}  {frame}" for frame, n in counts.most_common(TOP)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=64, help="simulated harnesses")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured (sampled) time")
    parser.add_argument("--stream", action="store_true", help="streamed calls (SSE)")
    parser.add_argument("--context", type=int, default=512, help="prompt tokens")
    parser.add_argument("--rate", type=int, default=250, help="samples per second")
    parser.add_argument("--out", type=Path, help="write the collapsed stacks here")
    parser.add_argument("--native", action="store_true",
                        help="C and Cython frames too (asyncpg, uvloop, msgspec)")
    args = parser.parse_args(argv)
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")  # PATH first
    if not Path(py_spy).exists():
        raise SystemExit("no py-spy: pip install the project's dev extra (py-spy==0.4.1)")
    datname = f"rolltap_bench_{uuid.uuid4().hex[:10]}"
    admin_sql(f'CREATE DATABASE "{datname}"')
    tmp = Path(tempfile.mkdtemp(prefix="rolltap-profile-"))
    port = free_port()
    upstream = standin.start(port, context=(args.context, 32))
    gateway = Gateway(f"http://127.0.0.1:{port}", f"{POSTGRES_URL.rpartition('/')[0]}/{datname}",
                      tmp / "gateway.log")  # fmt: skip
    try:
        gateway.start()
        keys = [gateway.new_rollout()["api_key"] for _ in range(args.concurrency)]
        raw = tmp / "stacks.txt"
        spy = [py_spy, "record", "--pid", str(gateway.pid), "--duration",
               str(int(args.seconds) + 2), "--rate", str(args.rate), "--format", "raw",
               "--output", str(raw),
               # py-spy unwinds native frames only from a stopped process.
               *(["--native"] if args.native else ["--nonblocking"])]  # fmt: skip
        spied: list[subprocess.CompletedProcess] = []
        sampler = threading.Thread(target=lambda: spied.append(
            subprocess.run(spy, capture_output=True, text=True)))  # fmt: skip
        sampler.start()
        r = run_loadgen(LoadSpec(
            url=gateway.url, keys=keys, stream=args.stream, unknown_turn=False,
            requests=10_000_000, seconds=args.seconds, warmup=2 if args.concurrency > 1 else 20,
            pids={"proxy": [gateway.pid]}, context_tokens=args.context,
        ))  # fmt: skip
        sampler.join()
        if not raw.exists():
            said = spied[0].stderr[-2000:] if spied else ""
            raise SystemExit(f"py-spy wrote nothing: {' '.join(spy)}\n{said}")
        stacks = collapsed(raw)
        print(f"{len(r.latency_s)} calls, {r.cpu_s['proxy'] * 1e6 / max(len(r.latency_s), 1):.0f}"
              f" µs gateway CPU per call (py-spy adds its pauses' cost)")  # fmt: skip
        print(report(stacks))
        if args.out:
            shutil.copy(raw, args.out)
    finally:
        gateway.stop()
        upstream.terminate()
        upstream.wait(10)
        admin_sql(f'DROP DATABASE IF EXISTS "{datname}" WITH (FORCE)')
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
