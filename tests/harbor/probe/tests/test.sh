#!/bin/bash
# The verifier: the probe's findings decide the reward; whether the verifier itself was given
# the rollout's key is reported beside it.
exec python3 - <<'PY'
import json, os
p = json.load(open("/app/probe.json"))
ok = (p["models"] == 200 and p["chat"] == 200 and p["admin"] in (401, 403)
      and not p["postgres"] and p["secrets"] == ["ANTHROPIC_API_KEY", "OPENAI_API_KEY"])
saw = any(k in os.environ for k in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY"))
json.dump({"reward": 1 if ok else 0, "verifier_saw_key": 1 if saw else 0,
           "chat_status": p["chat"], "admin_status": p["admin"] or 0,
           "postgres_reached": 1 if p["postgres"] else 0},
          open("/logs/verifier/reward.json", "w"))
PY
