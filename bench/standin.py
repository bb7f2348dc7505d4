"""A STAND-IN upstream for benchmarks: it replays real recorded vLLM responses, instantly or
(`--latency-median`) after a long-tailed delay per call, as agents' engines feel under load.

Real vLLM on a CPU needs tens of milliseconds per token, which buries the gateway's own cost of
a few hundred microseconds per call. This server answers `/v1/chat/completions` (streamed or not)
with responses recorded once from a real vLLM serving the project's tiny model (`bench/data/`),
so the only work left on a benchmarked path is the gateway's. It is not a model server and is
never used by tests.

It is written on raw asyncio (uvloop) rather than a web framework so it costs as little CPU as
possible and is never the bottleneck: every answer is pre-encoded bytes. It understands just the
HTTP/1.1 the benchmark's clients send (keep-alive, `Content-Length` bodies).

    python -m bench.standin --port 8100          # serve the recordings
    python -m bench.standin --record             # re-record them from a fresh real vLLM
    python -m bench.standin --record --upstream http://127.0.0.1:8000   # ... from a running one

It also takes a trainer's weight sync (pause, reload, resume: answered, ignored), so a real
`rolltap bridge` can train against it (bench/bench_throughput.py).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import math
import random
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import msgspec

from bench import standin_template

DATA = Path(__file__).resolve().parent / "data"
REQUEST = DATA / "request.json"  # the harness-side request the benchmark clients send
WHOLE = DATA / "chat_completion.json"  # vLLM's non-streamed response body, as sent
STREAM = DATA / "chat_completion_stream.jsonl"  # vLLM's SSE `data:` payloads, one per line
META = DATA / "recording.json"  # how and from what the recordings were made

COMPLETION_TOKENS = 64
STREAM_ATTEMPTS = 10


class _Sent(msgspec.Struct):
    prompt_token_ids: msgspec.Raw = msgspec.Raw(b"null")


class _Flags(msgspec.Struct):
    stream: bool = False
    max_tokens: int | None = None
    kv_transfer_params: _Sent | None = None
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False


_flags = msgspec.json.Decoder(_Flags)


def _http(status: str, content_type: bytes, body: bytes) -> bytes:
    head = f"HTTP/1.1 {status}\r\ncontent-length: {len(body)}\r\ncontent-type: "
    return head.encode() + content_type + b"\r\n\r\n" + body


def _chunk(payload: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(payload), payload)


class Replies:
    """Every answer the stand-in gives, encoded once."""

    def __init__(self, data_dir: Path = DATA) -> None:
        whole = (data_dir / WHOLE.name).read_bytes().strip()
        events = [ln for ln in (data_dir / STREAM.name).read_bytes().splitlines() if ln.strip()]
        model = msgspec.json.decode(whole)["model"]
        models = msgspec.json.encode(
            {"object": "list", "data": [{"id": model, "object": "model", "owned_by": "standin"}]}
        )
        self.model = model
        self.whole = _http("200 OK", b"application/json", whole)
        self.health = _http("200 OK", b"application/json", b"{}")
        self.models = _http("200 OK", b"application/json", models)
        self.not_found = _http("404 Not Found", b"application/json", b'{"error":"not found"}')
        # What a trainer's weight sync asks of vLLM (trainer_bridge/weights.py): the device, and
        # pause, reload and resume, all taken and ignored (the replies are recorded ones).
        self.server_info = _http("200 OK", b"application/json",
                                 b'{"vllm_config":{"device_config":{"device":"cpu"}}}')
        self.synced = _http("200 OK", b"application/json", b'{"success":true}')
        # Seconds before each chat completion is answered (None: at once); --latency-median.
        self.latency: Callable[[], float] | None = None
        self.bad = _http("400 Bad Request", b"application/json", b'{"error":"bad request"}')
        # Chunked transfer encoding, one chunk per SSE event, as vLLM's server frames a stream.
        self.stream_head = (
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        self.stream_frames = [_chunk(b"data: " + e + b"\n\n") for e in events]
        self.stream_frames.append(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")

    def answer(self, flags: _Flags, body: bytes) -> list[bytes]:
        """What to send for one chat completion request, in writes."""
        return [self.stream_head, *self.stream_frames] if flags.stream else [self.whole]

    def render(self, body: bytes) -> bytes:
        """The answer to a render request: only a stand-in with a template has one."""
        return self.not_found


class Synthetic(Replies):
    """Replies for a context of `prompt_tokens` and `completion_tokens` sampled ones, cut from
    the recorded ones (repeated past their length). Each call's prompt ends in `fresh_tokens`
    new ids (the harness's new turn), so the gateway stores a delta and its base search
    compares real prefixes. The prompt ids are echoed the way vLLM does with
    `return_token_ids`: whole in the response, or in the first chunk of a stream; a request
    that fixes its prompt (`kv_transfer_params`
    `prompt_token_ids`) gets exactly those back. A stream has the request's `max_tokens`
    chunks if it names any (the recorded ones over again past them), so one chunk's cost can
    be told from a whole call's.

    With `template` (prompt_tokens is then ignored) the prompt is the request's messages
    rendered by the stand-in's template (bench/standin_template.py), which also serves vLLM's
    render endpoint: a conversation that grows turn by turn can be continued exactly.

    With `vary` each call's reply starts at a random token of the recorded one, so replies
    differ as sampled ones do: a trainer that packs shared prefixes once then has each
    sample's own tokens to train, not one reply shared by the whole group."""

    def __init__(
        self,
        prompt_tokens: int,
        completion_tokens: int,
        fresh_tokens: int = 64,
        data_dir=DATA,
        template: bool = False,
        vary: bool = False,
    ) -> None:
        super().__init__(data_dir)
        self._template = template
        rng = random.Random(prompt_tokens)
        self._fixed = [rng.randrange(2048) for _ in range(prompt_tokens - fresh_tokens)]
        self._fresh = fresh_tokens
        self._rng = rng
        self._completion_tokens = completion_tokens
        whole = msgspec.json.decode((data_dir / WHOLE.name).read_bytes())
        whole.pop("prompt_token_ids")
        self._whole = whole
        recorded = whole["choices"][0]["token_ids"]
        self._starts = len(recorded) if vary else 1
        events = [
            msgspec.json.decode(ln)
            for ln in (data_dir / STREAM.name).read_bytes().splitlines()
            if ln.strip()
        ]
        first, usage = events[0], events[-1]
        first.pop("prompt_token_ids")
        self._first = first
        self._tokens = events[1:-1]
        self._frames: dict[tuple, list[bytes]] = {}
        self._wholes: dict[tuple, dict] = {}  # by shape and start: at most 4 x 64 of them
        self._usage = usage
        self._tail = _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"

    def _reply(self, start: int) -> dict:
        """The recorded reply from token `start` on, over again past its length (as a stream's
        chunks are), `completion_tokens` long."""
        whole = msgspec.json.decode(msgspec.json.encode(self._whole))
        choice, n = whole["choices"][0], self._completion_tokens
        recorded, ids = choice["logprobs"]["content"], choice["token_ids"]
        content = [recorded[(start + i) % len(recorded)] for i in range(n)]
        choice["logprobs"]["content"] = content
        choice["token_ids"] = [ids[(start + i) % len(ids)] for i in range(n)]
        choice["message"]["content"] = "".join(e["token"] for e in content)
        return whole

    def _token_frames(self, n: int, flags: _Flags, start: int) -> list[bytes]:
        key = (n, flags.return_token_ids, flags.return_tokens_as_token_ids, start)
        frames = self._frames.get(key)
        if frames is None:
            tokens = self._tokens
            events = [_as_asked(tokens[(start + i) % len(tokens)], flags) for i in range(n)]
            events[-1]["choices"][0]["finish_reason"] = "length"
            frames = [_chunk(b"data: " + msgspec.json.encode(e) + b"\n\n") for e in events]
            self._frames[key] = frames
        return frames

    def _prompt(self, flags: _Flags, body: bytes) -> tuple[bytes, int]:
        sent = flags.kv_transfer_params
        if sent is not None and bytes(sent.prompt_token_ids) != b"null":
            raw = bytes(sent.prompt_token_ids)
            # Counted, not decoded: 32k ids as Python ints would cost the stand-in a millisecond a
            # call, CPU taken from the proxies measured beside it on a 2-core machine.
            return raw, (raw.count(b",") + 1 if raw.strip(b"[] \t\r\n") else 0)
        if self._template:
            return standin_template.render_json(msgspec.json.decode(body))
        ids = self._fixed + [self._rng.randrange(2048) for _ in range(self._fresh)]
        return msgspec.json.encode(ids), len(ids)

    def render(self, body: bytes) -> bytes:
        if not self._template:
            return self.not_found
        ids, _ = standin_template.render_json(msgspec.json.decode(body))
        return _http("200 OK", b"application/json", b'{"token_ids":' + ids + b"}")

    def answer(self, flags: _Flags, body: bytes) -> list[bytes]:
        prompt, n = self._prompt(flags, body)
        sampled = (flags.stream and flags.max_tokens) or self._completion_tokens
        usage = {"prompt_tokens": n, "total_tokens": n + sampled, "completion_tokens": sampled}
        echo = prompt if flags.return_token_ids else None
        start = self._rng.randrange(self._starts) if self._starts > 1 else 0
        if not flags.stream:
            shape = (flags.return_token_ids, flags.return_tokens_as_token_ids, start)
            whole = self._wholes.get(shape) or self._wholes.setdefault(
                shape, _as_asked(self._reply(start), flags)
            )
            body = _with_prompt(whole | {"usage": usage}, echo)
            return [_http("200 OK", b"application/json", body)]
        first = _chunk(b"data: " + _with_prompt(self._first, echo) + b"\n\n")
        last = _chunk(b"data: " + msgspec.json.encode(self._usage | {"usage": usage}) + b"\n\n")
        return [self.stream_head, first, *self._token_frames(sampled, flags, start), last,
                self._tail]


def _with_prompt(obj: dict, prompt: bytes | None) -> bytes:
    """`obj` encoded with `prompt_token_ids` (already encoded) as its last field, if echoed."""
    if prompt is None:
        return msgspec.json.encode(obj)
    return msgspec.json.encode(obj)[:-1] + b',"prompt_token_ids":' + prompt + b"}"


def _as_asked(event: dict, flags: _Flags) -> dict:
    """A copy of a recorded response or chunk with the id fields vLLM sends for `flags`: the
    sampled `token_ids` only with `return_token_ids`, logprob tokens written `token_id:N` with
    `return_tokens_as_token_ids`."""
    event = copy.deepcopy(event)
    for choice in event.get("choices") or ():
        ids = choice.get("token_ids") or ()
        content = (choice.get("logprobs") or {}).get("content")
        if flags.return_tokens_as_token_ids and content:
            for entry, token_id in zip(content, ids, strict=True):
                entry["token"] = f"token_id:{token_id}"
                entry["bytes"] = list(entry["token"].encode())
        if not flags.return_token_ids:
            choice.pop("token_ids", None)
    return event


_WEIGHT_SYNC = (b"/pause", b"/resume", b"/collective_rpc", b"/reset_prefix_cache")


class _Connection(asyncio.Protocol):
    __slots__ = ("_replies", "_transport", "_buf")

    def __init__(self, replies: Replies) -> None:
        self._replies = replies
        self._transport: asyncio.Transport | None = None
        self._buf = bytearray()

    def connection_made(self, transport) -> None:
        self._transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(buf[:end]).lower()
            length = 0
            at = head.find(b"\r\ncontent-length:")
            if at >= 0:
                stop = head.find(b"\r\n", at + 2)
                length = int(head[at + 17 : stop if stop >= 0 else len(head)])
            elif b"\r\ntransfer-encoding:" in head:
                self._transport.write(self._replies.bad)  # not sent by the benchmark's clients
                self._transport.close()
                return
            if len(buf) < end + 4 + length:
                return
            body = bytes(buf[end + 4 : end + 4 + length])
            del buf[: end + 4 + length]
            self._answer(head, body)

    def _send(self, frames: list[bytes]) -> None:
        if self._transport is None or self._transport.is_closing():
            return  # the client left while the call waited (an aborted rollout's)
        for frame in frames:  # one send per event, as a live engine would
            self._transport.write(frame)

    def _answer(self, head: bytes, body: bytes) -> None:
        r = self._replies
        write = self._transport.write
        line = head[: head.find(b"\r\n")] if b"\r\n" in head else head
        method, _, rest = line.partition(b" ")
        path = rest.partition(b" ")[0].partition(b"?")[0]
        if method == b"post" and path == b"/v1/chat/completions":
            try:
                flags = _flags.decode(body)
            except msgspec.DecodeError:
                write(r.bad)
                return
            frames = r.answer(flags, body)
            if r.latency is None:
                self._send(frames)
            else:
                asyncio.get_running_loop().call_later(r.latency(), self._send, frames)
        elif method == b"post" and path in _WEIGHT_SYNC:
            write(r.synced)
        elif method == b"get" and path == b"/server_info":
            write(r.server_info)
        elif method == b"post" and path == b"/v1/chat/completions/render":
            write(r.render(body))
        elif method == b"get" and path == b"/v1/models":
            write(r.models)
        elif method == b"get" and path == b"/health":
            write(r.health)
        else:
            write(r.not_found)


async def serve(host: str, port: int, replies: Replies) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: _Connection(replies), host, port, backlog=1024, reuse_address=True
    )
    print(f"stand-in upstream on http://{host}:{port}", flush=True)
    async with server:
        await server.serve_forever()


def start(
    port: int,
    data_dir: Path = DATA,
    argv: list[str] | None = None,
    context: tuple[int, int] | None = None,
    template: bool = False,
) -> subprocess.Popen:
    """The stand-in (or `argv`, another stand-in module) in its own process; returns once it
    answers `/health`. `context`: (prompt, completion) tokens of synthetic replies; `template`:
    their prompts rendered from the messages (see `Synthetic`)."""
    argv = argv or ["-m", "bench.standin", "--port", str(port), "--data-dir", str(data_dir)]
    if context:
        argv += ["--prompt-tokens", str(context[0]), "--completion-tokens", str(context[1])]
    if template:
        argv.append("--template")
    proc = subprocess.Popen(
        [sys.executable, *argv],
        cwd=Path(__file__).resolve().parents[1],
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"stand-in upstream exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("stand-in upstream did not answer /health within 30 s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.standin",
        description="Stand-in upstream replaying recorded vLLM responses with no delay (for "
        "benchmarks of the gateway's own cost), or --record to re-record them.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--data-dir", type=Path, default=DATA)
    parser.add_argument(
        "--record",
        action="store_true",
        help="record the responses from a real vLLM (started on the tiny model unless "
        "--upstream names a running one), then exit",
    )
    parser.add_argument("--upstream", metavar="URL", help="with --record: a running vLLM")
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        help="synthetic replies: a prompt of this many tokens (default: the recorded replies)",
    )
    parser.add_argument("--completion-tokens", type=int, default=32, help="with --prompt-tokens")
    parser.add_argument(
        "--template",
        action="store_true",
        help="with --prompt-tokens: render each request's messages for its prompt, and serve "
        "the render endpoint",
    )
    parser.add_argument("--latency-median", type=float, metavar="S",
                        help="answer each chat completion after a lognormal delay with this "
                        "median (seconds)")
    parser.add_argument("--latency-sigma", type=float, default=1.0,
                        help="the delay's log-space spread (1.0: the 99th percentile is about "
                        "10x the median)")
    parser.add_argument("--vocab", type=int, help="with --template: keep rendered ids below this")
    parser.add_argument("--vary", action="store_true",
                        help="with --prompt-tokens: start each reply at a random token of the "
                        "recorded one, so replies differ as sampled ones do")
    args = parser.parse_args(argv)
    if args.record:
        from bench.standin_record import record

        print(json.dumps(record(args.data_dir, args.upstream), indent=1))
        return 0
    import uvloop

    try:
        replies = (
            Synthetic(
                args.prompt_tokens,
                args.completion_tokens,
                data_dir=args.data_dir,
                template=args.template,
                vary=args.vary,
            )
            if args.prompt_tokens
            else Replies(args.data_dir)
        )
        if args.vocab:
            standin_template.set_vocab(args.vocab)
        if args.latency_median is not None:
            rng = random.Random(0)
            median, sigma = args.latency_median, args.latency_sigma
            replies.latency = lambda: rng.lognormvariate(math.log(median), sigma)
        uvloop.run(serve(args.host, args.port, replies))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
