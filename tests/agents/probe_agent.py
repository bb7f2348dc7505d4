"""A hostile agent for security tests: from inside its sandbox it tries everything a rollout
key must not allow, and prints what happened as one JSON line."""

from __future__ import annotations

import json
import os
from pathlib import Path


def run(*, prompt: str, base_url: str, api_key: str, model: str, workdir: str) -> None:
    import httpx

    other = json.loads(prompt)["other_rollout"]
    root = base_url.removesuffix("/v1")
    mine = {"Authorization": f"Bearer {api_key}"}
    attempts = {
        "create_rollout_with_key": ("POST", "/admin/rollouts", mine, {}),
        "create_rollout_without_key": ("POST", "/admin/rollouts", {}, {}),
        "read_other_calls": ("GET", f"/admin/rollouts/{other}/calls", mine, None),
        "read_other_summary_x_api_key": ("GET", f"/admin/rollouts/{other}",
                                         {"x-api-key": api_key}, None),
        "finish_other": ("POST", f"/admin/rollouts/{other}/finish", mine, {"reward": 1.0}),
        "finish_self": ("POST", f"/admin/rollouts/{json.loads(prompt)['self']}/finish", mine,
                        {"reward": 1.0}),
        "set_policy": ("POST", "/admin/policy", mine, {"version": 999}),
    }
    report = {}
    for name, (method, path, headers, body) in attempts.items():
        r = httpx.request(method, root + path, headers=headers, json=body, timeout=30)
        report[name] = r.status_code
    # The model routes work with the key: the agent is not simply cut off.
    r = httpx.post(base_url + "/chat/completions", headers=mine, timeout=120, json={
        "model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    report["own_model_call"] = r.status_code
    report["env_has_admin_key"] = any("ADMIN" in k for k in os.environ)
    report["visible_files"] = sorted(p.name for p in Path(workdir).rglob("*"))
    print(json.dumps(report))
