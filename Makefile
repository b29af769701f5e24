# Two entry points, both work on a fresh clone: `make demo` and `make test`.
PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup demo test lint clean

DEMO_STAMP := $(VENV)/.demo-installed

# pip byte-compiles every file it installs, one at a time (85 s for the test stack's 17,600 files on
# a 2-core machine); one compileall over every core afterwards makes the same .pyc files in 46 s. As
# pip does, it skips the few files written for a newer Python (torch's py312_intrinsics.py).
PIP     := $(BIN)/pip install --quiet --no-compile
COMPILE = $(BIN)/python -m compileall -q -j 0 $(1) > /dev/null || true

# torch first, alone: on these machines pip takes both wheels from local disk (5.6 GB, most of it
# torch's CUDA libraries, which the torch 2.14.1 wheel brings even on a CPU machine).
TORCH_STAMP := $(VENV)/.torch-installed

$(TORCH_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(PIP) torch==2.14.1 torchvision==0.29.1
	touch $(TORCH_STAMP)

# What `make demo` needs: torch and mixprec.
$(DEMO_STAMP): $(TORCH_STAMP)
	$(PIP) -e .
	$(call COMPILE,$(VENV)/lib)
	touch $(DEMO_STAMP)

# What `make test` needs: mixprec, the test tools and every stack mixprec exports to or measures
# (all `make demo` needs among them: its stamp is set too). DeepSpeed (in the frameworks extra) is an
# sdist: its wheel is built against the torch above (no build isolation, which would fetch another
# torch), no CUDA ops, its CPU shared-memory comm op compiled now (else its first use JIT-compiles
# it, ~1.5 min; no wheel cache: a cached wheel built without the op would be reused), with ninja on
# PATH so the op's two files compile at once. That build is two minutes of one core (one of the two
# files is most of it): it starts as soon as torch is in, while pip installs mixprec and the other
# stacks and one compileall makes every .pyc, then its wheel is installed from disk (on the 2-core
# AMX Xeon, setup 198 s -> 174 s against building it after `make demo`'s install and compile). The
# requirements come from pyproject's frameworks extra, split in two.
FRAMEWORKS = $(PYTHON) -c "import tomllib, sys; r = tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['frameworks']; print(' '.join(x for x in r if x.startswith('deepspeed') == (sys.argv[1] == 'deepspeed')))"
WHEELS := $(VENV)/wheels

$(STAMP): $(TORCH_STAMP)
	$(PIP) "setuptools>=77" ninja
	rm -rf $(WHEELS)
	PATH="$(abspath $(BIN)):$$PATH" DS_BUILD_OPS=0 DS_BUILD_SHM_COMM=1 $(BIN)/pip wheel --quiet --no-deps \
		--no-build-isolation --no-cache-dir --wheel-dir $(WHEELS) $$($(FRAMEWORKS) deepspeed) & build=$$!; \
	$(PIP) -e ".[dev,fp8,timm,hf,tensorflow]" $$($(FRAMEWORKS) others); installed=$$?; \
	$(call COMPILE,$(VENV)/lib); \
	wait $$build && test $$installed = 0
	$(PIP) $(WHEELS)/deepspeed-*.whl
	$(BIN)/pip check
	# (only what the wheel added: another compileall over the whole venv re-reads every .pyc, 12 s)
	$(call COMPILE,$(VENV)/lib/python*/site-packages/deepspeed)
	touch $(STAMP) $(DEMO_STAMP)

# One recipe at a time, even under -j: `make -j setup demo` on a fresh clone would otherwise run the
# two stamps' pip installs and byte-compiles into one venv at once.
.NOTPARALLEL:

setup: $(STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/mixprec env
	$(BIN)/mixprec tune --report mixprec-out/report --json mixprec-out/tune.json

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples
	$(BIN)/mypy

# MIXPREC_REQUIRE_FRAMEWORKS=1: the frameworks tier fails instead of skipping when one is missing.
# -n auto: one pytest-xdist worker per core (each on one intra-op thread: tests/conftest.py); most of
# the suite's time is single-threaded (process start-up, Python) and CI has 2 cores. --durations
# lists the slowest tests in the log, where a slow one shows up first.
# Lint runs beside the suite (mypy is half a minute of one core, hidden under the suite's start-up)
# and counts the same: its output follows the suite's, and either failing fails `make test`.
# mixprec's own source is byte-compiled first, as the venv's is at setup: the suite starts hundreds of
# Python processes that import it (candidates, scripts under the agent, ranks), and where
# PYTHONDONTWRITEBYTECODE is set (these sessions' shells set it) each compiled its 250 modules again, about
# 0.7 s of a core apiece (tests/frameworks/test_script.py starts 33 of them: 206 s -> 195 s).
test: $(STAMP)
	@$(call COMPILE,src)
	@$(MAKE) --no-print-directory lint > $(VENV)/lint.log 2>&1 & lint=$$!; \
	MIXPREC_REQUIRE_FRAMEWORKS=1 $(BIN)/python -m pytest -q -n auto --dist worksteal --durations=25; \
	tests=$$?; wait $$lint; linted=$$?; echo "--- make lint"; cat $(VENV)/lint.log; \
	if [ $$linted != 0 ]; then echo "make lint failed" >&2; exit $$linted; fi; exit $$tests

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build src/*.egg-info
