# Two entry points, both work on a fresh clone: `make demo` and `make test`.
PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup demo test lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# pinned torch first: on these machines pip takes both wheels from local disk
	$(BIN)/pip install --quiet torch==2.14.1 torchvision==0.29.1
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/mixprec env
	$(BIN)/mixprec tune --report mixprec-out/report --json mixprec-out/tune.json

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples
	$(BIN)/mypy

test: $(STAMP) lint
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build src/*.egg-info
