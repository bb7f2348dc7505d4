"""Benchmark of core.merge: merge time and stored bytes for synthetic agent rollouts.

Bytes counted per call: prompt ids 4 B/token; completion ids, logprobs and policy versions
4 + 4 + 4 B per sampled token. "naive" stores every call's whole prompt; "linear" stores only the
prompt tokens past the call's best base (best_base over the earlier calls, as the gateway does at
record time); "traces" is the merged output, 13 B per sequence token (ids 4, mask 1, logprobs 4,
versions 4). Row headers, compression and request bodies are not counted. "long rollout": one
merge of 1k, 10k and 40k calls of modest length (long_rollout): its time and peak memory.

Run: python -m bench.bench_merge
"""

from __future__ import annotations

import multiprocessing
import statistics
import time

import numpy as np

from core.merge import merge
from core.merge.prefixes import best_base
from core.merge.values import CallTokens

VOCAB = 150_000
SYSTEM_TOKENS = 3_000


class _Builder:
    """Calls the way an agent harness produces them: a main agent whose context grows to the
    limit, sub-agents on the same system prompt, and now and then a retry, a re-rendered
    (drifted) answer, an edited history, a title or summary side call, a compaction."""

    def __init__(self, n_calls: int, max_context: int, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.max_context = max_context
        self.calls: list[CallTokens] = []
        self.system = self.tokens(SYSTEM_TOKENS)
        # Spread the growth to the limit over the main agent's share of the calls.
        self.step = max(64, (max_context - SYSTEM_TOKENS) // max(1, int(n_calls * 0.75)))

    def tokens(self, n: int) -> np.ndarray:
        return self.rng.integers(1, VOCAB, size=n, dtype=np.int32)

    def call(self, prompt: np.ndarray, completion_len: int, tools: bool = True) -> CallTokens:
        seq = len(self.calls) + 1
        call = CallTokens(
            id=f"call-{seq}",
            seq=seq,
            prompt_ids=prompt,
            completion_ids=self.tokens(completion_len),
            logprobs=-self.rng.random(completion_len, dtype=np.float32),
            versions=np.full(completion_len, seq // 20, dtype=np.int32),
            status="ok",
            offered_tools=tools,
        )
        self.calls.append(call)
        return call

    def turn(self, context: np.ndarray, step: int) -> CallTokens:
        new = self.tokens(int(step * 0.8))
        if context.size + new.size + step > self.max_context:
            # Compaction: the system prompt and a summary start over.
            context, new = self.system, self.tokens(2_000)
        return self.call(np.concatenate([context, new]), max(8, step // 5))

    def rollout(self, n_calls: int) -> list[CallTokens]:
        # Each thread is represented by its last call.
        threads = [self.call(np.concatenate([self.system, self.tokens(500)]), 200)]
        while len(self.calls) < n_calls:
            roll = self.rng.random()
            main = threads[0]
            if roll < 0.03:
                # The main agent's last request is retried; the harness goes on with the retry.
                threads[0] = self.call(main.prompt_ids, main.completion_ids.size)
            elif roll < 0.06:
                # The harness re-rendered the last answer with one token different.
                rendered = _full(main)
                rendered[int(self.rng.integers(main.prompt_ids.size, rendered.size))] ^= 1
                threads[0] = self.turn(rendered, self.step)
            elif roll < 0.08:
                # Edited history: cut somewhere after the first user turn, go on from there.
                cut = int(self.rng.integers(SYSTEM_TOKENS + 700, _full(main).size))
                threads[0] = self.turn(_full(main)[:cut], self.step)
            elif roll < 0.10:
                self.call(self.tokens(300), 12, tools=False)
            elif roll < 0.13:
                threads.append(self.call(np.concatenate([self.system, self.tokens(400)]), 150))
            else:
                k = 0 if roll < 0.75 else int(self.rng.integers(0, len(threads)))
                threads[k] = self.turn(_full(threads[k]), self.step if k == 0 else self.step // 2)
        return self.calls


def _full(call: CallTokens) -> np.ndarray:
    return np.concatenate([call.prompt_ids, call.completion_ids])


def agent_rollout(n_calls: int, max_context: int = 32_768, seed: int = 0) -> list[CallTokens]:
    return _Builder(n_calls, max_context, seed).rollout(n_calls)


def rerendered_rollout(n_calls: int, max_context: int = 32_768, seed: int = 0) -> list[CallTokens]:
    """Worst realistic case: every turn re-renders the previous answer differently (the tiny
    model's norm), so every call is its own root."""
    builder = _Builder(n_calls, max_context, seed)
    last = builder.call(np.concatenate([builder.system, builder.tokens(500)]), 200)
    while len(builder.calls) < n_calls:
        rendered = _full(last)
        rendered[-1] ^= 1
        last = builder.turn(rendered, builder.step)
    return builder.calls


def long_rollout(n_calls: int, turns: int = 16, seed: int = 0) -> list[CallTokens]:
    """Many calls of modest length: conversations of `turns` turns on one short system prompt,
    each compacted and started over, with a re-rendered answer (a fork) in one turn of ten and a
    retry in one of thirty. The merge's cost in calls, not in context length."""
    rng = np.random.default_rng(seed)
    calls: list[CallTokens] = []
    system = rng.integers(1, VOCAB, size=200, dtype=np.int32)

    def call(prompt: np.ndarray) -> CallTokens:
        n = len(calls) + 1
        calls.append(CallTokens(
            id=f"call-{n}", seq=n, prompt_ids=prompt,
            completion_ids=rng.integers(1, VOCAB, size=16, dtype=np.int32),
            logprobs=np.full(16, -0.5, dtype=np.float32),
            versions=np.full(16, n // 100, dtype=np.int32), status="ok", offered_tools=True))
        return calls[-1]

    while len(calls) < n_calls:
        context = np.concatenate([system, rng.integers(1, VOCAB, size=100, dtype=np.int32)])
        for _ in range(min(turns, n_calls - len(calls))):
            roll = rng.random()
            if roll < 0.1 and len(calls) and context.size > system.size + 100:
                context = context.copy()
                context[-1] ^= 1  # the harness re-rendered the last answer
            last = call(np.concatenate([context,
                                        rng.integers(1, VOCAB, size=20, dtype=np.int32)]))
            if roll > 0.97:
                last = call(last.prompt_ids)  # retried
            context = _full(last)
    return calls[:n_calls]


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith(field + ":"))


def _measure_merge(n_calls: int, out) -> None:
    calls = long_rollout(n_calls)
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # the peak (VmHWM) starts again from what the rollout's input holds
    before = _status_kib("VmRSS")
    start = time.perf_counter()
    result = merge(calls)
    seconds = time.perf_counter() - start
    out.send({"calls": n_calls, "seconds": seconds,
              "peak_bytes": (_status_kib("VmHWM") - before) << 10,
              "tokens": sum(c.prompt_ids.size + c.completion_ids.size for c in calls),
              "sequences": result.stats.sequences})


def scale(n_calls: int) -> dict:
    """Time and peak memory of one merge of a long_rollout of `n_calls`, in a child process
    of its own: the peak is how far its resident memory rose above what held the input."""
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_measure_merge, args=(n_calls, send))
    child.start()
    result = receive.recv()
    child.join()
    return result


def stored_bytes(calls: list[CallTokens]) -> tuple[int, int, float]:
    """(naive, linear) bytes, and the seconds best_base took over the rollout."""
    naive = linear = 0
    seconds = 0.0
    earlier: list[tuple[str, np.ndarray]] = []
    for call in sorted(calls, key=lambda c: c.seq):
        start = time.perf_counter()
        _, shared = best_base(call.prompt_ids, earlier)
        seconds += time.perf_counter() - start
        sampled = 12 * call.completion_ids.size
        naive += 4 * call.prompt_ids.size + sampled
        linear += 4 * (call.prompt_ids.size - shared) + sampled
        earlier.append((call.id, _full(call)))
    return naive, linear, seconds


def measure(name: str, calls: list[CallTokens], repeats: int = 7) -> dict:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = merge(calls)
        times.append(time.perf_counter() - start)
    naive, linear, base_seconds = stored_bytes(calls)
    stats = result.stats
    return {
        "scenario": name,
        "calls": len(calls),
        "max_context": max(c.prompt_ids.size for c in calls),
        "merge_ms": 1000 * statistics.median(times),
        "merge_min_ms": 1000 * min(times),
        "best_base_ms": 1000 * base_seconds,
        "naive_bytes": naive,
        "linear_bytes": linear,
        "trace_bytes": 13 * sum(s.input_ids.size for s in result.sequences),
        "sequences": stats.sequences,
        "lost_tokens": stats.lost_tokens,
        "causes": stats.causes,
    }


def run(print_fn=print) -> dict:
    rows = [measure(f"agent-{n}", agent_rollout(n)) for n in (10, 50, 200)]
    rows.append(measure("rerendered-200", rerendered_rollout(200)))
    header = (
        f"{'scenario':<16}{'calls':>6}{'max ctx':>9}{'merge ms':>10}{'min':>6}{'base ms':>9}"
        f"{'naive MB':>10}{'linear MB':>11}{'ratio':>7}{'traces MB':>11}{'seqs':>6}"
        f"{'lost':>6}  causes"
    )
    print_fn(header)
    for r in rows:
        causes = " ".join(f"{k}={v}" for k, v in r["causes"].items() if v)
        print_fn(
            f"{r['scenario']:<16}{r['calls']:>6}{r['max_context']:>9}{r['merge_ms']:>10.1f}"
            f"{r['merge_min_ms']:>6.1f}{r['best_base_ms']:>9.1f}{r['naive_bytes'] / 1e6:>10.2f}"
            f"{r['linear_bytes'] / 1e6:>11.2f}{r['naive_bytes'] / r['linear_bytes']:>7.1f}"
            f"{r['trace_bytes'] / 1e6:>11.2f}{r['sequences']:>6}{r['lost_tokens']:>6}  {causes}"
        )
    print_fn("")
    print_fn(f"{'long rollout':<14}{'calls':>8}{'tokens M':>10}{'merge s':>9}{'peak MiB':>10}"
             f"{'B/token':>9}{'seqs':>7}")
    for n in (1_000, 10_000, 40_000):
        r = scale(n)
        print_fn(f"{'':<14}{n:>8}{r['tokens'] / 1e6:>10.1f}{r['seconds']:>9.2f}"
                 f"{r['peak_bytes'] / 2**20:>10.0f}{r['peak_bytes'] / r['tokens']:>9.1f}"
                 f"{r['sequences']:>7}")
    return {r["scenario"]: r for r in rows}


if __name__ == "__main__":
    run()
