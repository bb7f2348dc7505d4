"""Per-call cost and storage that do not grow with the context (issue 14).

1. Storage of one 200-call agent rollout, as the gateway writes its rows: prompt ids past the
   call's best base (4 B a token), completion ids, logprobs and versions (12 B a sampled token),
   the compressed reply summary, and the request body, whole (before: every call stores its
   whole conversation again) or as a delta against its base call's body (now,
   core/store/bodies.py). The goal: at most 1.2x the rollout's unique tokens at 4 B each plus
   its new text compressed (each call's added request bytes and its reply, zstd per call).
   The conversation is synthetic but shaped like a coding agent's: a long system prompt and
   tool list, then tool calls and tool results of a few hundred to a few thousand tokens of
   word-like text (compressible about as much as real text), one body encoding per call as an
   SDK sends it.
2. Continuation keys of a request at about 20k tokens: hashed from scratch (before) against
   resumed from the request it extends (now).
3. Memory of the recent-calls index at 32k-token calls: before, 8 id arrays for each of up to
   4,096 rollouts and no bound in bytes; now, bounded by `--recent-calls-mib`, which also holds
   the ids' JSON and the body and continuation keys of the calls not yet continued; calls whose
   ids open the newest call's keep views of its array and the pieces of its JSON.

    python -m bench.bench_storage     # this section alone; `python -m bench` runs all
"""

from __future__ import annotations

import gc
import json
import statistics
import time
import tracemalloc

import msgspec
import numpy as np
import zstandard

from core.merge.prefixes import best_base
from core.store import bodies
from gateway import engine_ids
from gateway.continuation.keys import RequestKeys
from gateway.protocols import chat
from gateway.protocols.normalize import normalize_messages
from gateway.rollout_memory import RecentCalls

CALLS = 200
CHARS_PER_TOKEN = 4
TARGET_RATIO = 1.2
_zstd = zstandard.ZstdCompressor(level=bodies.LEVEL)


class _Text:
    """Word-like text from a fixed vocabulary: zstd shrinks it about as much as prose or code."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        letters = np.array(list("etaoinshrdlucmfwypvbgkqjxz_"))
        self.words = ["".join(self.rng.choice(letters, size=int(n))) for n in
                      self.rng.integers(2, 10, size=4000)]  # fmt: skip
        # Zipf-like: a few words are everywhere, most are rare.
        weights = 1.0 / np.arange(1, len(self.words) + 1)
        self.p = weights / weights.sum()

    def __call__(self, tokens: int) -> str:
        out: list[str] = []
        size = 0
        while size < tokens * CHARS_PER_TOKEN:
            word = self.words[int(self.rng.choice(len(self.words), p=self.p))]
            out.append(word)
            size += len(word) + 1
        return " ".join(out)


class Call(msgspec.Struct):
    raw: bytes  # the request body as sent
    added: bytes  # the messages it adds to the request before, as JSON
    prompt: np.ndarray
    completion: np.ndarray
    reply: dict


def agent_rollout(n_calls: int = CALLS, seed: int = 0) -> list[Call]:
    """The calls of one conversation growing call by call."""
    text = _Text(seed)
    rng = np.random.default_rng(seed + 1)
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "description": text(60),
                                               "parameters": {"type": "object"}}}
             for i in range(12)]  # fmt: skip
    messages = [{"role": "system", "content": text(3000)}, {"role": "user", "content": text(200)}]
    prompt = rng.integers(1, 150_000, size=3300 + 12 * 70, dtype=np.int32)
    out: list[Call] = []
    added = messages
    for k in range(n_calls):
        body = {"model": "agent", "messages": messages, "tools": tools, "stream": True,
                "max_tokens": 8192}  # fmt: skip
        raw = json.dumps(body, separators=(",", ":")).encode()
        # Sampled tokens are about a quarter of what a turn adds, as in bench_merge's rollouts.
        reply_tokens = int(rng.integers(20, 120))
        completion = rng.integers(1, 150_000, size=reply_tokens, dtype=np.int32)
        reply = {"role": "assistant", "content": text(reply_tokens // 2),
                 "tool_calls": [{"id": f"call_{k}", "type": "function", "function": {
                     "name": "tool_1", "arguments": json.dumps({"cmd": text(20)})}}]}  # fmt: skip
        out.append(Call(raw, json.dumps(added).encode(), prompt, completion, reply))
        result_tokens = int(rng.integers(50, 500))
        added = [reply,
                 {"role": "tool", "tool_call_id": f"call_{k}", "content": text(result_tokens)}]
        messages = [*messages, *added]
        prompt = np.concatenate(
            (prompt, completion, rng.integers(1, 150_000, size=result_tokens + 4, dtype=np.int32))
        )
    return out


def storage(calls: list[Call]) -> dict:
    tokens = bodies_whole = bodies_delta = replies = new_text = unique = 0
    earlier: list[tuple[int, np.ndarray]] = []
    summaries: list[bytes] = []
    for i, call in enumerate(calls):
        base, shared = best_base(call.prompt, earlier)
        unique += call.prompt.size - shared + call.completion.size
        tokens += 4 * (call.prompt.size - shared) + 12 * call.completion.size
        reply = msgspec.json.encode(call.reply)
        summary = msgspec.json.encode({"message": call.reply, "finish_reason": "tool_calls"})
        replies += len(_zstd.compress(summary))
        bodies_whole += len(bodies.whole(call.raw))
        bodies_delta += len(
            bodies.whole(call.raw)
            if base is None
            else bodies.delta(calls[base].raw, call.raw, summaries[base])
        )
        summaries.append(summary)
        new_text += len(_zstd.compress(call.added)) + len(_zstd.compress(reply))
        earlier.append((i, np.concatenate((call.prompt, call.completion))))
    goal = TARGET_RATIO * (4 * unique + new_text)
    return {
        "calls": len(calls),
        "final_tokens": int(calls[-1].prompt.size + calls[-1].completion.size),
        "unique_tokens": unique,
        "new_text_bytes": new_text,
        "token_bytes": tokens,
        "reply_bytes": replies,
        "body_whole_bytes": bodies_whole,
        "body_delta_bytes": bodies_delta,
        "before_bytes": tokens + replies + bodies_whole,
        "after_bytes": tokens + replies + bodies_delta,
        "goal_bytes": goal,
    }


def _conversation(rounds: int) -> dict:
    system = {"role": "system", "content": "You are a coding agent. " * 400}
    messages = [system, {"role": "user", "content": "Build it."}]
    for k in range(rounds):
        call = {"id": f"c{k}", "type": "function",
                "function": {"name": "run", "arguments": '{"cmd": "make"}'}}  # fmt: skip
        messages += [
            {"role": "assistant", "content": f"step {k} " * 20, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"c{k}", "content": f"output {k}\n" * 60},
        ]
    return {"model": "agent", "messages": messages}


def _median_us(fn, repeats: int = 51) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def keys_cost(rounds: int) -> dict:
    """A request of `rounds` tool rounds, hashed from scratch and rolling."""
    body = _conversation(rounds)
    previous = {**body, "messages": body["messages"][:-2]}
    parent = RequestKeys(previous)
    return {
        "messages": len(body["messages"]),
        "approx_tokens": len(msgspec.json.encode(body["messages"])) // CHARS_PER_TOKEN,
        "scratch_us": _median_us(lambda: RequestKeys(body)),
        "rolling_us": _median_us(lambda: RequestKeys(body, [parent])),
    }


def index_memory(rollouts: int = 64, budget_mib: int = 64) -> dict:
    """The index fed `rollouts` rollouts of 8 calls of a 32k-token chat conversation under a
    `budget_mib` bound, as the relay feeds it: each call's body is parsed from the previous
    call's layout, its keys roll on from the previous call's, and it continues that call with
    64 new ids (ids, their JSON, body, keys, layout). What the index counts is set beside the
    memory it holds (tracemalloc); before: what 8 id arrays of 4,096 rollouts take."""
    messages = _conversation(115)["messages"]
    raws = [
        msgspec.json.encode({"model": "agent", "messages": messages[: len(messages) - 2 * k]})
        for k in range(7, -1, -1)
    ]
    tokens = len(raws[-1]) // CHARS_PER_TOKEN
    rng = np.random.default_rng(0)
    recent = RecentCalls(budget_mib << 20)
    peak = 0
    tracemalloc.start()
    try:
        held_before = tracemalloc.get_traced_memory()[0]
        for r in range(rollouts):
            ids = rng.integers(0, 150_000, tokens).astype(np.int32)
            pieces = (msgspec.json.encode(ids.tolist()),)
            for c, raw in enumerate(raws):
                calls = recent.entries(r) or []
                body, layout = chat.parse(raw, [e.request for e in calls[::-1] if e.request])
                keys = RequestKeys(
                    {"messages": normalize_messages(body["messages"], raw)},
                    [e.keys for e in calls[::-1] if e.keys is not None],
                )
                if c:
                    new = rng.integers(0, 150_000, 64).astype(np.int32)
                    ids = np.concatenate((ids, new))
                    pieces = engine_ids.extend(pieces, msgspec.json.encode(new.tolist()))
                recent.add(r, c, ids, keys, body=raw, full_json=pieces,
                           supersedes=c - 1 if c else None, request=layout.kept())  # fmt: skip
                peak = max(peak, recent.nbytes)
        del body, layout, keys, calls
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - held_before
    finally:
        tracemalloc.stop()
    per_rollout = recent.nbytes / len(recent)
    return {
        "tokens": tokens,
        "before_bytes": 4096 * 8 * 4 * tokens,
        "budget_bytes": budget_mib << 20,
        "peak_bytes": peak,
        "held_bytes": held,
        "counted_bytes": recent.nbytes,
        "rollouts_kept": len(recent),
        "per_rollout_bytes": per_rollout,
        "default_rollouts": int((512 << 20) // per_rollout),
    }


def run(print_fn=print) -> dict:
    s = storage(agent_rollout())
    mb = 1e6
    print_fn(
        f"storage of one {s['calls']}-call rollout ({s['final_tokens']} tokens at the end, "
        f"{s['unique_tokens']} unique)"
    )
    print_fn(f"{'':<34}{'before MB':>10}{'after MB':>10}")
    for label, before, after in (
        ("token arrays", "token_bytes", "token_bytes"),
        ("reply summaries", "reply_bytes", "reply_bytes"),
        ("request bodies", "body_whole_bytes", "body_delta_bytes"),
        ("total", "before_bytes", "after_bytes"),
    ):
        print_fn(f"  {label:<32}{s[before] / mb:>10.3f}{s[after] / mb:>10.3f}")
    base = s["goal_bytes"] / TARGET_RATIO
    print_fn(
        f"  4 B x unique tokens + new text compressed ({s['new_text_bytes'] / mb:.3f} MB) = "
        f"{base / mb:.3f} MB; stored: before {s['before_bytes'] / base:.2f}x, after "
        f"{s['after_bytes'] / base:.2f}x of it (goal {TARGET_RATIO}x: "
        f"{'met' if s['after_bytes'] <= s['goal_bytes'] else 'MISSED'})"
    )
    keys = [keys_cost(rounds) for rounds in (70, 140)]
    for k in keys:
        print_fn(
            f"continuation keys, {k['messages']} messages (~{k['approx_tokens']} tokens): from "
            f"scratch {k['scratch_us']:.0f} us, rolling {k['rolling_us']:.0f} us"
        )
    m = index_memory()
    print_fn(
        f"recent-calls index at {m['tokens']} tokens a call: before up to "
        f"{m['before_bytes'] / 2**30:.1f} GiB (8 id arrays x 4096 rollouts, no bound in bytes); "
        f"now {m['per_rollout_bytes'] / 2**20:.2f} MiB a rollout (8 calls' ids as views of the "
        f"newest call's, their JSON as its pieces, its body, layout and keys), peak "
        f"{m['peak_bytes'] / 2**20:.1f} MiB under a {m['budget_bytes'] >> 20} MiB bound; it "
        f"holds {m['held_bytes'] / m['counted_bytes']:.2f}x what it counts (tracemalloc: "
        f"{m['held_bytes'] / 2**20:.1f} MiB for {m['counted_bytes'] / 2**20:.1f}); the default "
        f"512 MiB holds {m['default_rollouts']} such rollouts"
    )
    return {"storage": s, "keys": keys, "index": m}


if __name__ == "__main__":
    run()
