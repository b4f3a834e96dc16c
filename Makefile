# Every target creates .venv itself, so a fresh clone needs nothing but Python 3.11+.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

.PHONY: demo test lint types pytest services bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet -e . --group dev
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/idempo demo

test: $(STAMP) lint types services pytest

lint: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench

types: $(STAMP)
	$(BIN)/mypy

services: $(STAMP)
	$(BIN)/python tests/check_services.py

pytest: $(STAMP)
	IDEMPO_TEST_REQUIRE_ALL=1 $(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python -m pip install --quiet --group bench -e .
	$(BIN)/python bench/postgres_tx.py

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
