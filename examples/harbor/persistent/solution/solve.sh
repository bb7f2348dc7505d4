#!/bin/bash
# Detached: this exec returns while the process goes on, as a task's service would.
setsid sleep 600 </dev/null >/dev/null 2>&1 &
echo $! > /app/server.pid
