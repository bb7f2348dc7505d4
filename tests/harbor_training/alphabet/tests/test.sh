#!/bin/bash
# The reward is the fraction of the alphabet the answer uses: a graded score, so the members of
# a group sampled from one policy get different rewards.
exec python3 - <<'PY'
import json, string
try:
    answer = open("/app/answer.txt").read().lower()
except OSError:
    answer = ""
used = set(answer) & set(string.ascii_lowercase)
json.dump({"reward": round(len(used) / 26, 4)}, open("/logs/verifier/reward.json", "w"))
PY
