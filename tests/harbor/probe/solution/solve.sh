#!/bin/bash
# Runs as the agent: one model call through the gateway with the rollout's key, then what else
# the sandbox reaches, into /app/probe.json for the verifier.
exec python3 - <<'PY'
import json, os, socket, urllib.request, urllib.error

base, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
root = os.environ["ANTHROPIC_BASE_URL"]

def call(url, body=None):
    req = urllib.request.Request(url, data=json.dumps(body).encode() if body else None,
                                 headers={"Authorization": f"Bearer {key}",
                                          "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, None

status, models = call(f"{base}/models")
model = models["data"][0]["id"]
chat, _ = call(f"{base}/chat/completions", {"model": model, "max_tokens": 4,
               "messages": [{"role": "user", "content": "hi"}]})
admin, _ = call(f"{root}/admin/rollouts", {"task_id": "mine-now"})
try:
    socket.create_connection(("127.0.0.1", 5432), timeout=2).close()
    postgres = True
except OSError:
    postgres = False
secrets = sorted(k for k in os.environ if "KEY" in k or "TOKEN" in k or "SECRET" in k)
json.dump({"models": status, "chat": chat, "admin": admin, "postgres": postgres,
           "secrets": secrets, "uid": os.getuid()}, open("/app/probe.json", "w"))
PY
