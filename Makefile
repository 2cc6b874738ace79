# The two commands of the README: `make train` (the main job) and `make test`.
# Both create .venv on first use; torch is pinned by constraints-dev.txt so
# that pip takes the CPU build and never resolves a CUDA one.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup train test
setup: $(STAMP)

$(STAMP): pyproject.toml constraints-dev.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints-dev.txt -e ".[dev,bench,cpu,triton]"
	touch $@

train: setup
	$(BIN)/hopq train $(ARGS)

test: setup
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests
	$(BIN)/mypy src
	$(BIN)/python -m pytest tests
