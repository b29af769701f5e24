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
	# The frameworks extra (the stacks mixprec exports to, tested in tests/exports). DeepSpeed is an
	# sdist: built against the torch above (no build isolation, which would fetch another torch), no
	# CUDA ops, its CPU shared-memory comm op compiled now (else its first use JIT-compiles it, ~1.5 min;
	# no wheel cache: a cached wheel built without the op would be reused).
	$(BIN)/pip install --quiet "setuptools>=77"
	DS_BUILD_OPS=0 DS_BUILD_SHM_COMM=1 $(BIN)/pip install --quiet --no-build-isolation --no-cache-dir \
		"deepspeed>=0.19,<0.20"
	$(BIN)/pip install --quiet -e ".[dev,frameworks,fp8,timm,hf,tensorflow]"
	$(BIN)/pip check
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/mixprec env
	$(BIN)/mixprec tune --report mixprec-out/report --json mixprec-out/tune.json

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples
	$(BIN)/mypy

# MIXPREC_REQUIRE_FRAMEWORKS=1: the frameworks tier fails instead of skipping when one is missing.
test: $(STAMP) lint
	MIXPREC_REQUIRE_FRAMEWORKS=1 $(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build src/*.egg-info
