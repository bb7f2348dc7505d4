#!/bin/bash
# A flat reward.json: `reward` is the reward; the other keys are diagnostics.
lines=$(cat /app/count.txt 2>/dev/null | grep -c .)
if [ "$(cat /app/count.txt 2>/dev/null)" = "$(seq 1 3)" ]; then ok=1; else ok=0; fi
printf '{"reward": %s, "lines": %s, "partial": 0.5}\n' "$ok" "$lines" > /logs/verifier/reward.json
