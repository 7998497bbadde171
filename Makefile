# Flywheel: the two commands a newcomer needs are `make demo` and `make test`.
# Everything is installed into .venv (git-ignored) and reused while the lock is unchanged.

PYTHON ?= python3.11
VENV ?= .venv
ACCEL ?= cpu
LOCK := requirements/$(ACCEL).lock
STAMP := $(VENV)/.flywheel-installed
PY := $(VENV)/bin/python
FLYWHEEL := $(VENV)/bin/flywheel
PYTEST_ARGS ?=

.PHONY: setup demo test test-unit test-compose test-sdk-compat lint up down status model bench-byo bench-flywheel bench-% lock clean help

help:
	@echo "make demo   - set up, start the local stack, run the main job, shut down"
	@echo "make test   - set up, start what the tests need, run the lint checks and the whole test suite"
	@echo "make test-compose - the production compose project in a real Docker engine, the loop through its ingresses (as root)"
	@echo "make test-sdk-compat - the SDK's tests at the lowest and the highest versions its dependency ranges allow"
	@echo "make lint   - unique test basenames, the layer contracts (lint-imports), ruff check, ruff format --check"
	@echo "make up / make down / make status - the local stack alone"
	@echo "make bench-<name> - run bench/<name>.py (e.g. make bench-ingest)"
	@echo "make bench-byo MODEL=PATH - the real loop on any causal-LM folder (bench/byo.py)"
	@echo "make bench-flywheel SCENARIO=parl - the demo headless against its target (arith by default)"

setup: $(STAMP)

# Reinstall only when the lock or the project metadata change.
$(STAMP): $(LOCK) pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found; install Python 3.11 or run 'make PYTHON=/path/to/python3.11'"; exit 1; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps -r $(LOCK)
	@# The distribution was named "flywheel" before it became flywheel-rl: a venv made then still holds
	@# that install: its metadata (plug-in entry points, commands, its own editable finder) would stay beside the new one.
	@! $(PY) -m pip show --quiet flywheel 2>/dev/null || $(PY) -m pip uninstall --quiet --disable-pip-version-check -y flywheel
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	@$(PY) -c "import flywheel, ingest, rewarding, trainer, serving" || { echo "error: the installed package does not import"; exit 1; }
	@touch $(STAMP)

model: setup
	$(FLYWHEEL) model build

up: setup
	$(FLYWHEEL) up

down:
	@test -x $(FLYWHEEL) && $(FLYWHEEL) down || true

status: setup
	$(FLYWHEEL) status

demo: setup
	$(FLYWHEEL) demo

# The layers (import-linter contracts in pyproject.toml, see docs/architecture.md) and ruff.
lint: setup
	@dupes=$$(find tests -name 'test_*.py' -printf '%f\n' | sort | uniq -d); \
	  test -z "$$dupes" || { echo "error: test basenames must be unique (pytest collects them as one module): $$dupes"; exit 1; }
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Tests start the real services they need themselves (broker, Postgres, Redis, vLLM),
# in a temporary run folder on their own ports, and stop them at the end.
test: setup lint
	$(FLYWHEEL) model build
	@scripts/ensure-chromium.sh
	$(PY) -m pytest $(PYTEST_ARGS)

# The SDK alone in fresh venvs at both ends of its dependency ranges (scripts/sdk-compat.sh).
test-sdk-compat:
	scripts/sdk-compat.sh

test-unit: setup
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

# The production compose file, for real: a Docker engine (Debian's docker.io, started if none runs),
# images built from Debian's packages and this checkout, the whole project up with the CPU override,
# the loop driven through the router, the gateway and the admin API, down and up again with the
# volumes kept (tests/compose/compose_loop.py; docs/deploy.md). Needs root; prints one JSON line.
test-compose: setup
	$(PY) tests/compose/compose_loop.py $(COMPOSE_ARGS)

bench-train: setup
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps -r requirements/bench.txt
	$(PY) bench/train.py

# The real loop on any causal-LM folder: make bench-byo MODEL=PATH (BYO_ARGS="--mode lora" for LoRA).
bench-byo: setup
	@test -n "$(MODEL)" || { echo "error: name the model folder: make bench-byo MODEL=PATH"; exit 2; }
	$(PY) bench/byo.py "$(MODEL)" $(BYO_ARGS)

# The demo headless against its target: make bench-flywheel SCENARIO=parl (default arith).
SCENARIO ?= arith
bench-flywheel: setup
	$(PY) bench/flywheel.py --scenario "$(SCENARIO)"

bench-%: setup
	$(PY) bench/$*.py

# Regenerate the lock from the current environment (after changing pyproject.toml).
lock:
	$(PY) -m pip freeze --exclude-editable | grep -v '^flywheel' > /tmp/flywheel-freeze.txt
	{ sed -n '1,4p' $(LOCK); echo "setuptools==78.1.1"; cat /tmp/flywheel-freeze.txt; } > $(LOCK).new && mv $(LOCK).new $(LOCK)

clean:
	rm -rf $(VENV) .flywheel .pytest_cache
