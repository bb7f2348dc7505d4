"""The protocol adapters alone, in-process: CPU and memory per upstream chunk of each
protocol's `Stream` (translation only: no HTTP, no capture, no recording). `bench_protocols`
prints it after its end-to-end table.

Two workloads from the recorded vLLM chat stream: `text` as recorded, and `mixed`, the same
chunks relabelled as reasoning, then text, then one tool call's arguments, so every segment kind
and its transitions are paid for.

This file imports only `gateway.protocols`, so another checkout's adapters can be measured with
the same code, side by side:

    python -m bench.adapter_costs                  # this checkout
    python -m bench.adapter_costs --against DIR    # and the checkout at DIR, in a subprocess
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import msgspec

DATA = Path(__file__).resolve().parent / "data"
CHAT_STREAM = DATA / "chat_completion_stream.jsonl"
COMPLETION_STREAM = DATA / "completion_stream.jsonl"
ROUNDS = 500  # timed passes over each stream
PROTOCOLS = ("chat", "anthropic", "responses", "completions")


def _payloads(path: Path) -> list[bytes]:
    return [line for line in path.read_bytes().splitlines() if line]


def _mixed(payloads: list[bytes]) -> list[bytes]:
    """The chat stream's text deltas as reasoning, text, then one tool call's arguments."""
    chunks = [msgspec.json.decode(p) for p in payloads]
    texts = [
        i for i, c in enumerate(chunks) if c["choices"] and c["choices"][0]["delta"].get("content")
    ]
    third = len(texts) // 3
    for n, i in enumerate(texts):
        delta = chunks[i]["choices"][0]["delta"]
        text = delta.pop("content")
        if n < third:
            delta["reasoning"] = text
        elif n < 2 * third:
            delta["content"] = text
        else:
            call: dict = {"index": 0, "function": {"arguments": text}}
            if n == 2 * third:
                call.update(id="call_bench", type="function")
                call["function"]["name"] = "bash"
            delta["tool_calls"] = [call]
    return [msgspec.json.encode(c) for c in chunks]


def _contexts() -> dict:
    from gateway.protocols import anthropic, chat, completions, responses

    messages = [{"role": "user", "content": "Fix read_lines."}]
    return {
        "chat": (
            chat,
            chat.to_upstream({"model": "tiny", "messages": messages, "stream": True})[1],
        ),
        "anthropic": (
            anthropic,
            anthropic.to_upstream(
                anthropic.parse_request(
                    msgspec.json.encode(
                        {"model": "tiny", "messages": messages, "max_tokens": 64, "stream": True}
                    )
                )
            )[1],
        ),
        "responses": (
            responses,
            responses.to_upstream(
                responses.parse_request(
                    msgspec.json.encode({"model": "tiny", "input": "Fix it.", "stream": True})
                )
            )[1],
        ),
        "completions": (
            completions,
            completions.to_upstream({"model": "tiny", "prompt": "def f():", "stream": True})[1],
        ),
    }


def _cpu_us(proto, ctx, payloads: list[bytes]) -> float:
    """One stream's feed + close, per chunk, in µs: the 10th percentile over ROUNDS, which
    leaves out the rounds other processes on the machine preempted."""
    decode = msgspec.json.decode
    per_round = []
    gc.disable()
    try:
        for _ in range(ROUNDS):
            chunks = [decode(p) for p in payloads]  # fresh: the OpenAI adapters edit chunks
            t0 = time.perf_counter_ns()
            stream = proto.Stream(ctx)
            for c in chunks:
                stream.feed(c)
            stream.close()
            per_round.append((time.perf_counter_ns() - t0) / 1e3 / len(chunks))
    finally:
        gc.enable()
    return statistics.quantiles(per_round, n=10)[0]


def _alloc_bytes(proto, ctx, payloads: list[bytes]) -> float:
    """Bytes allocated within one `feed`, per chunk: the traced peak above the level before it
    (the output bytes included)."""
    chunks = [msgspec.json.decode(p) for p in payloads]
    peaks = []
    tracemalloc.start()
    try:
        stream = proto.Stream(ctx)
        for c in chunks:
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
            stream.feed(c)
            peaks.append(tracemalloc.get_traced_memory()[1] - before)
    finally:
        tracemalloc.stop()
    return sum(peaks) / len(chunks)


def measure() -> dict:
    chat_stream = _payloads(CHAT_STREAM)
    workloads = {
        "text": {p: chat_stream for p in PROTOCOLS if p != "completions"}
        | {"completions": _payloads(COMPLETION_STREAM)},
        "mixed": {p: _mixed(chat_stream) for p in ("anthropic", "responses")},
    }
    contexts = _contexts()
    rows = {}
    for workload, streams in workloads.items():
        for name, payloads in streams.items():
            proto, ctx = contexts[name]
            rows[f"{name}/{workload}"] = {
                "chunks": len(payloads),
                "cpu_us_per_chunk": _cpu_us(proto, ctx, payloads),
                "alloc_bytes_per_chunk": _alloc_bytes(proto, ctx, payloads),
            }
    return rows


def format_table(sides: dict[str, dict]) -> str:
    """`sides`: label -> `measure()` rows; one column pair per side."""
    labels = list(sides)
    head = f"{'adapter/workload':<20}{'chunks':>7}"
    head += "".join(f"  | {lb[-17:]:>17}" for lb in labels)
    sub = " " * 27 + "".join(f"  | {'CPU µs':>8}{'alloc B':>9}" for _ in labels)
    lines = [head, sub, "-" * len(sub)]
    first = sides[labels[0]]
    for key in first:
        cells = "".join(
            f"  | {sides[lb][key]['cpu_us_per_chunk']:>8.2f}"
            f"{sides[lb][key]['alloc_bytes_per_chunk']:>9.0f}"
            for lb in labels
        )
        lines.append(f"{key:<20}{first[key]['chunks']:>7}{cells}")
    lines.append(
        "per upstream chunk: CPU µs = feed + close of the whole stream, the best of each side's\n"
        "runs (10th percentile of rounds within a run); alloc B = bytes allocated within one feed\n"
        "(traced peak above the level before it, the output included)."
    )
    return "\n".join(lines)


def _best(runs: list[dict]) -> dict:
    return {
        key: {
            **runs[0][key],
            "cpu_us_per_chunk": min(r[key]["cpu_us_per_chunk"] for r in runs),
        }
        for key in runs[0]
    }


def run(print_fn=print, against: str | None = None, runs: int = 5) -> dict:
    """Measures this checkout (and the one at `against`, in a subprocess), alternating the
    sides `runs` times so that load from elsewhere on the machine falls on both."""
    mine, theirs = [], []
    env = dict(os.environ, PYTHONPATH=str(Path(against).resolve())) if against else None
    for _ in range(runs):
        if against:
            out = subprocess.run(
                [sys.executable, __file__, "--json"], env=env, check=True, capture_output=True
            ).stdout
            theirs.append(json.loads(out))
        mine.append(measure())
    sides = {against: _best(theirs)} if against else {}
    sides["this checkout"] = _best(mine)
    print_fn(format_table(sides))
    return sides


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--against", metavar="DIR", help="also measure the checkout at DIR")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.json:
        print(json.dumps(measure()))
    else:
        run(against=args.against)
    return 0


if __name__ == "__main__":
    sys.exit(main())
