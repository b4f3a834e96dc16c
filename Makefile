# Every target creates .venv itself, so a fresh clone needs nothing but Python 3.11+.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PROJECT_HASH := $(shell cat pyproject.toml | sha1sum | cut -c1-12)
STAMP := $(VENV)/.installed-$(PROJECT_HASH)
DEMO_STAMP := $(VENV)/.demo-$(PROJECT_HASH)

.PHONY: demo test lint types pytest services bench bench-instructions clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet -e . --group dev
	touch $(STAMP)

# The demo needs only idempo's `demo` extra, not the dev tools; a venv that has the dev group
# has it already.
$(DEMO_STAMP): $(BIN)/python pyproject.toml
	@if [ -e $(STAMP) ]; then :; else \
		echo "make demo: installing idempo and its demo extra into $(VENV) ..."; \
		$(BIN)/python -m pip install --progress-bar on --disable-pip-version-check -e '.[demo]' \
			|| exit 1; \
	fi
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/idempo demo

test: $(STAMP) lint types services pytest

lint: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench

types: $(STAMP)
	$(BIN)/mypy

services: $(STAMP)
	$(BIN)/python tests/check_services.py

# pytest-xdist workers, one per core of the 2-core machines the suite runs on (docs/testing.md);
# `make test PYTEST_WORKERS=0` runs it in one process.
PYTEST_WORKERS ?= 2

pytest: $(STAMP)
	IDEMPO_TEST_REQUIRE_ALL=1 $(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadgroup

# Every family of benchmarks, then one table of each path against its goal (bench/floor.py).
# The HTTP family drives its servers with wrk: installed from Debian's packages when it is
# missing (issue 15), and only skipped, with a word, where apt cannot install it.
bench: $(STAMP)
	$(BIN)/python -m pip install --quiet --group bench -e .
	@command -v wrk >/dev/null 2>&1 || { \
		echo "make bench: wrk is missing; installing it (apt-get install wrk) ..."; \
		{ apt-get install -y -qq wrk >/dev/null 2>&1 \
			|| { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq wrk >/dev/null 2>&1; }; } \
		|| echo "make bench: could not install wrk (no apt, or not root): the http family is skipped"; \
	}
	$(BIN)/python bench/floor.py

# The same paths counted in client instructions under valgrind (callgrind): load-independent,
# so a change can be judged on a busy machine (bench/floor.py --instructions).
bench-instructions: $(STAMP)
	$(BIN)/python -m pip install --quiet --group bench -e .
	$(BIN)/python bench/floor.py --instructions

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
