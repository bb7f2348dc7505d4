#!/bin/bash
# The verifier runs in a later exec: the process must still be there (one persistent sandbox
# per trial, as Harbor assumes). The verifier is another uid, which may not signal the agent's
# processes (kill -0 says "Operation not permitted"): it looks for the process in /proc.
pid=$(cat /app/server.pid 2>/dev/null)
if [ -n "$pid" ] && [ -d "/proc/$pid" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
