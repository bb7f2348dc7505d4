"""A STAND-IN for the gateway's admin API, not the gateway: only the shape the sandbox runner
uses (create, finish, get, the models it checks first; admin key checked) plus a trivial chat
endpoint that counts calls per rollout key (tests/integration/test_sandbox_runner.py says why)."""

from __future__ import annotations

import uuid
from collections import Counter

from aiohttp import web

from sandbox.tasks import Task, Timeouts, Verifier

ADMIN_KEY = "stand-in-admin-key-0123"


class StandInAdminAPI:
    """Stand-in for the gateway's admin API shape (see the module docstring)."""

    def __init__(self) -> None:
        self.rollouts: dict[str, dict] = {}
        self.by_key: dict[str, str] = {}
        self.in_flight = 0
        self.max_in_flight = 0
        self.bodies: list[bytes] = []
        self.refuse_tasks: set[str] = set()
        self.url = ""
        self._runner: web.AppRunner | None = None

    def _admin(self, request: web.Request) -> None:
        if request.headers.get("Authorization") != f"Bearer {ADMIN_KEY}":
            raise web.HTTPUnauthorized(text='{"error": "admin key required"}')

    def _summary(self, rid: str) -> dict:
        r = self.rollouts[rid]
        trained = sum(c["completion_tokens"] for c in r["calls"])
        merge = {"stats": {"trained_tokens": trained}} if r["status"] != "running" else None
        return {k: r[k] for k in ("rollout_id", "task_id", "group_id", "status", "reward",
                                  "calls", "metadata", "metrics")} | {"merge": merge}

    async def create(self, request: web.Request) -> web.Response:
        self._admin(request)
        body = await request.json()
        if body["task_id"] in self.refuse_tasks:
            return web.json_response({"error": "refused by the test"}, status=400)
        rid, key = str(uuid.uuid4()), f"rk-{uuid.uuid4().hex}"
        self.rollouts[rid] = {"rollout_id": rid, "task_id": body["task_id"],
                              "group_id": body["group_id"], "metadata": body["metadata"],
                              "timeout_s": body["timeout_s"], "side_calls": body["side_calls"],
                              "status": "running",
                              "reward": None, "metrics": None, "calls": []}
        self.by_key[key] = rid
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        return web.json_response({"rollout_id": rid, "api_key": key,
                                  "openai_base_url": f"{self.url}/v1",
                                  "anthropic_base_url": self.url}, status=201)

    async def finish(self, request: web.Request) -> web.Response:
        self._admin(request)
        rid = request.match_info["rid"]
        body = await request.json()
        r = self.rollouts[rid]
        if r["status"] == "running":
            self.in_flight -= 1
        r.update(status=body["status"], reward=body["reward"], metrics=body["metrics"])
        return web.json_response(self._summary(rid))

    async def get(self, request: web.Request) -> web.Response:
        self._admin(request)
        return web.json_response(self._summary(request.match_info["rid"]))

    async def models(self, request: web.Request) -> web.Response:
        self._admin(request)
        # The model the runner CLI asks for by default, as the preflight checks it.
        return web.json_response({"models": ["default"], "upstreams": []})

    async def chat(self, request: web.Request) -> web.Response:
        auth = request.headers.get("Authorization", "")
        rid = self.by_key.get(auth.removeprefix("Bearer "))
        if rid is None or self.rollouts[rid]["status"] != "running":
            return web.json_response({"error": {"message": "unknown key"}}, status=401)
        body = await request.read()
        self.bodies.append(body)
        calls = self.rollouts[rid]["calls"]
        calls.append({"seq": len(calls), "status": "ok", "prompt_tokens": 11,
                      "completion_tokens": 5, "finish_reason": "stop"})
        return web.json_response({"choices": [{"message": {"role": "assistant",
                                                           "content": "ok"}}]})

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/admin/rollouts", self.create)
        app.router.add_post("/admin/rollouts/{rid}/finish", self.finish)
        app.router.add_get("/admin/rollouts/{rid}", self.get)
        app.router.add_get("/admin/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        assert self._runner is not None
        await self._runner.cleanup()

    def finished_keys(self) -> Counter:
        return Counter((r["task_id"], r["metadata"]["repeat"], r["metadata"]["member"])
                       for r in self.rollouts.values() if r["status"] == "finished")

    def created_keys(self) -> Counter:
        return Counter((r["task_id"], r["metadata"]["repeat"], r["metadata"]["member"])
                       for r in self.rollouts.values())


def task(tid: str, prompt: str, agent_s: float = 60.0) -> Task:
    return Task(id=tid, prompt=prompt, files={"README.md": b"task\n"},
                verifier=Verifier("test -f out.txt", "binary", {}),
                timeouts=Timeouts(agent_s=agent_s, verifier_s=30.0, setup_s=30.0))
