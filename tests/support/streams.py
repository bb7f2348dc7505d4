"""Streaming chat calls held open from threads, for tests that kill, freeze or stop something
while streams are in flight."""

from __future__ import annotations

import json
import threading
import time

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
    """One streamed call read on its own thread; records how it ended. A refusal before the
    stream opens (429 or 503) is retried after its Retry-After, as the official SDKs do: a
    loaded gateway may refuse a new call for a moment, and that is not what these tests test."""

    RETRIES = 5

    def __init__(self, base_url: str, api_key: str, body: dict) -> None:
        self.chunks = 0
        self.done = False  # saw [DONE]
        self.error: dict | None = None  # the error event, if the stream ended with one
        self.status: int | None = None
        self.refused: list[str] = []  # the bodies of refusals that were retried
        self.request_id: str | None = None
        self.exception: BaseException | None = None
        self.started = threading.Event()  # the first data event arrived
        self.ended = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(base_url, api_key, body), daemon=True
        )
        self._thread.start()

    def _run(self, base_url: str, api_key: str, body: dict) -> None:
        try:
            with httpx.Client(timeout=httpx.Timeout(300, connect=10)) as http:
                for attempt in range(self.RETRIES + 1):
                    with http.stream(
                        "POST", f"{base_url}/chat/completions", json=body,
                        headers={"Authorization": f"Bearer {api_key}"},
                    ) as resp:
                        self.status = resp.status_code
                        self.request_id = resp.headers.get("x-request-id")
                        if resp.status_code in (429, 503) and attempt < self.RETRIES:
                            self.refused.append(resp.read().decode(errors="replace"))
                            time.sleep(float(resp.headers.get("retry-after", "1")))
                            continue
                        self._read(resp)
                        return
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            self.exception = exc
        finally:
            self.ended.set()

    def _read(self, resp: httpx.Response) -> None:
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

    def wait_started(self, timeout: float) -> None:
        """Returns once the first data event arrived; fails, saying how the call ended, if the
        stream ended (or did not start in `timeout` seconds) before one did."""
        deadline = time.monotonic() + timeout
        while not (self.started.is_set() or self.ended.is_set()):
            if time.monotonic() > deadline:
                raise AssertionError(f"no data event in {timeout:g} s")
            self.ended.wait(0.05)
        assert self.started.is_set(), (
            f"the stream never opened: HTTP {self.status}, error {self.error}, "
            f"exception {self.exception!r}, refusals retried {self.refused}")

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
        assert self.ended.is_set(), "stream still open"
