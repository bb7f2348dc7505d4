#!/bin/bash
# The verifier runs in a later exec: the process must still be there (one persistent sandbox
# per trial, as Harbor assumes).
if kill -0 "$(cat /app/server.pid 2>/dev/null)" 2>/dev/null; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
