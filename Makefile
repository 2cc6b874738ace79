# The two commands of the README: `make train` (the main job) and `make test`.
# Both create .venv on first use; torch is pinned by constraints-dev.txt so
# that pip takes the CPU build and never resolves a CUDA one. `make test` also
# builds .venv-torch (torch and hopq only, no extras) and runs every codec there.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TVENV ?= .venv-torch
TSTAMP := $(TVENV)/.installed

.PHONY: setup train test test-torch-only docs
setup: $(STAMP)

$(STAMP): pyproject.toml constraints-dev.txt Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints-dev.txt -e ".[dev,bench,cpu,triton,integrations,docs]"
	# torchtitan for the FSDP recipe's tests: its model, sharding, optimizer and
	# checkpoint wrappers, without its data packages (datasets pins huggingface_hub
	# below what transformers here uses; the tests load no data)
	$(BIN)/pip install -q -c constraints-dev.txt --no-deps torchtitan==0.3.0 \
		spmd-types==0.2.3 tyro==1.0.17 docstring-parser typeguard
	touch $@

$(TSTAMP): pyproject.toml constraints-dev.txt
	$(PY) -m venv $(TVENV)
	$(TVENV)/bin/pip install -q -c constraints-dev.txt -e .
	touch $@

train: setup
	$(BIN)/hopq train $(ARGS)

test-torch-only: $(TSTAMP)
	$(TVENV)/bin/python tests/torch_only.py

# The documentation site with its API reference; --strict fails on any warning
# (a broken link between pages, a docstring mkdocstrings cannot read).
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -d site

test: setup test-torch-only docs
	$(BIN)/ruff check src tests examples tools
	$(BIN)/ruff format --check src tests examples tools
	$(BIN)/mypy src
	$(BIN)/python -m pytest tests --durations=25
