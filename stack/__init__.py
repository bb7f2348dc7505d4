"""Whole-stack launchers: `rolltap demo` (tiny model or SmolLM2) and `make gpu-check`.

Each starts every part of a deployment as a process of its own (vLLM, the gateway with its
embedded Postgres, the bridge, the sandbox runner) and drives them over HTTP and their command
lines, so the launchers import neither the gateway nor the sandbox package (the learning
experiment, stack/experiment, takes the gateway's pinned sampling and the code-writer agent's
messages from them, so that its evaluation asks exactly as training does). They live in the
bridge's package because they start the bridge and its toy rollouts in-process.

Nothing here imports beyond the standard library at import time: `make gpu-check` runs its
first stage with any Python.
"""
