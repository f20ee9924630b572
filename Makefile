# Fresh machine: `make test` (set up + whole suite) and `make quickstart` (set up + the main CPU job).
VENV ?= .venv
PY := $(VENV)/bin/python
export VENV

.PHONY: setup test test-fast quickstart lint format bench clean docs

setup:
	@bash scripts/setup.sh

test: setup
	$(VENV)/bin/ruff check rlbridge tests bench
	$(VENV)/bin/ruff format --check rlbridge tests bench scripts
	$(VENV)/bin/mypy
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

quickstart: setup
	$(VENV)/bin/rlbridge validate-recipe recipes/quickstart.yaml
	$(VENV)/bin/rlbridge train recipes/quickstart.yaml

# Regenerate the recipe reference from the schema (tests/unit/test_docs.py fails while it is stale), then build
# the docs site into site/ as the test does (mkdocs.yml; `mkdocs serve` to read it).
docs: setup
	$(PY) -m rlbridge.recipe.docs > docs/recipe-reference.md
	$(PY) -m mkdocs build --strict

lint: setup
	$(VENV)/bin/ruff check rlbridge tests bench
	$(VENV)/bin/ruff format --check rlbridge tests bench scripts
	$(VENV)/bin/mypy

# Format the code as `make test` checks it (ruff format; line length 110, pyproject.toml).
format: setup
	$(VENV)/bin/ruff format rlbridge tests bench scripts

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
