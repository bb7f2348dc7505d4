"""Streaming chat load on a gateway while its database goes away or stalls: who asked when, and
what each call got."""

from __future__ import annotations

import threading
import time

import httpx

from tests.support.gateway import GatewayProcess


class Load:
    """`clients` threads, each streaming short chat calls of its own rollout, one after another;
    every call's (start, end, outcome, status, body) is kept."""

    def __init__(self, gw: GatewayProcess, model: str, clients: int) -> None:
        self.gw = gw
        self.model = model
        self.results: list[tuple[float, float, str, int, bytes]] = []
        self.rollouts = [gw.new_rollout(task_id=f"outage-{i}") for i in range(clients)]
        self._mine: list[list[tuple[float, float, str, int, bytes]]] = [[] for _ in range(clients)]
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(r, mine), daemon=True)
                         for r, mine in zip(self.rollouts, self._mine, strict=True)]

    def results_of(self, client: int) -> list[tuple[float, float, str, int, bytes]]:
        """The calls of one client (of rollout `self.rollouts[client]`)."""
        return self._mine[client]

    def _client(self, rollout: dict, mine: list) -> None:
        body = {"model": self.model, "stream": True, "max_tokens": 8,
                "messages": [{"role": "user", "content": "outage"}]}
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                started = time.monotonic()
                try:
                    r = client.post(rollout["openai_base_url"] + "/chat/completions", json=body,
                                    headers={"Authorization": f"Bearer {rollout['api_key']}"})
                    outcome = "ok" if r.status_code == 200 and b"data: [DONE]" in r.content \
                        else "error"
                    status, content = r.status_code, r.content
                except httpx.HTTPError as exc:
                    outcome, status, content = "transport", 0, repr(exc).encode()
                result = (started, time.monotonic(), outcome, status, content)
                self.results.append(result)
                mine.append(result)
                if outcome != "ok":
                    time.sleep(0.05)

    def wait_for_each_client_ok(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(any(r[2] == "ok" for r in list(mine)) for mine in self._mine):
                return
            time.sleep(0.1)
        raise AssertionError(f"not every client had a call succeed within {timeout} s")

    def wait_for_ok_after(self, moment: float, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(r[2] == "ok" and r[0] >= moment for r in list(self.results)):
                return
            time.sleep(0.1)
        raise AssertionError(f"no call succeeded within {timeout} s after the database was back")

    def __enter__(self):
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for t in self._threads:
            t.join(60)


def describe(results, outages) -> str:
    """Every call as `start+duration outcome status`, relative to the first, for a failure."""
    t0 = results[0][0]
    marks = [f"{k}: {b - t0:.2f}..{e - t0:.2f}" for k, b, e in outages]
    calls = [f"{s - t0:.2f}+{e - s:.2f} {o} {st} {c[-120:]!r}" if o != "ok" else
             f"{s - t0:.2f}+{e - s:.2f} ok" for s, e, o, st, c in results]
    return "\n".join(marks + calls)
