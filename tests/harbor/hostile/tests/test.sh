#!/bin/bash
# The verifier: 0 for the wrong answer, with what it found of the agent beside it.
exec python3 - <<'PY'
import json, os, time
answer = open("/app/answer.txt").read().strip()
pid = int(open("/app/rewriter.pid").read())
time.sleep(0.3)  # the rewriter has had its chances
alive = os.path.exists(f"/proc/{pid}")
try:
    open("/app/verifier-was-here", "w").write("the workdir is the verifier's to write")
    wrote = 1
except OSError:
    wrote = 0
json.dump({"reward": 1 if answer == "7" else 0, "rewriter_alive": int(alive),
           "same_uid": int(alive and os.stat(f"/proc/{pid}").st_uid == os.getuid()),
           "verifier_saw_key": int(any("API_KEY" in k for k in os.environ)),
           "hook_ran": 0, "wrote_workdir": wrote},
          open("/logs/verifier/reward.json", "w"))
PY
