"""Streaming chat calls held open from threads, for tests that kill, freeze or stop something
while streams are in flight."""

from __future__ import annotations

import json
import threading

import httpx

__all__ = ["OpenStream", "long_stream_body"]


def long_stream_body(model: str, max_tokens: int = 2000) -> dict:
    """A streamed chat request that runs until `max_tokens` (the engine ignores EOS)."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": "write for a long time"}],
        "stream": True,
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }


class OpenStream:
    """One streamed call read on its own thread; records how it ended."""

    def __init__(self, base_url: str, api_key: str, body: dict) -> None:
        self.chunks = 0
        self.done = False  # saw [DONE]
        self.error: dict | None = None  # the error event, if the stream ended with one
        self.status: int | None = None
        self.request_id: str | None = None
        self.exception: BaseException | None = None
        self.started = threading.Event()  # first data event arrived
        self.ended = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(base_url, api_key, body), daemon=True
        )
        self._thread.start()

    def _run(self, base_url: str, api_key: str, body: dict) -> None:
        try:
            with httpx.Client(timeout=httpx.Timeout(300, connect=10)) as http, http.stream(
                "POST", f"{base_url}/chat/completions", json=body,
                headers={"Authorization": f"Bearer {api_key}"},
            ) as resp:
                self.status = resp.status_code
                self.request_id = resp.headers.get("x-request-id")
                for line in resp.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        self.done = True
                        break
                    event = json.loads(data)
                    if "error" in event:
                        self.error = event["error"]
                        break
                    self.chunks += 1
                    self.started.set()
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            self.exception = exc
        finally:
            self.started.set()
            self.ended.set()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
        assert self.ended.is_set(), "stream still open"
