# `make test` and `make demo` work on a fresh machine: they find Python >= 3.13 (the MongoDB
# emulator needs it), create .venv and install the project with its dev extras.
PYTHON ?= $(shell for p in python3.13 python3.14 "$$(pyenv root 2>/dev/null)/versions/3.13"*/bin/python3 /root/.pyenv/versions/3.13*/bin/python3; do \
	command -v "$$p" >/dev/null 2>&1 && "$$p" -c 'import sys; sys.exit(sys.version_info < (3, 13))' 2>/dev/null && { echo "$$p"; break; }; done)
# The oldest Python the library supports, for `make test-oldest`.
OLDEST ?= $(shell for p in python3.10 "$$(pyenv root 2>/dev/null)/versions/3.10"*/bin/python3 /root/.pyenv/versions/3.10*/bin/python3; do \
	"$$p" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 10))' 2>/dev/null && { echo "$$p"; break; }; done)
VENV := .venv
BIN := $(VENV)/bin

.PHONY: test test-fast test-oldest coverage test-replset demo bench faults docs lint typecheck check clean

$(BIN)/.installed: pyproject.toml
	@test -n "$(PYTHON)" || { echo "error: Python >= 3.13 not found (set PYTHON=...)" >&2; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

# The suite runs on WORKERS processes (pytest-xdist), each with its own emulator: it mostly
# waits (leases, timeouts, brokers), and one process used a little over half a core. The broker
# tests stay together on one worker (tests/conftest.py); WORKERS=0 runs everything in one.
WORKERS ?= 2
PARALLEL = -n $(WORKERS) --dist loadgroup

test: $(BIN)/.installed
	$(BIN)/python -m pytest $(PARALLEL) $(PYTEST_ARGS)

# The fast tier a developer runs every few minutes (docs/testing.md, "Tiers"): the unit tests and
# the tests of the library against the emulator alone, without brokers, crash subprocesses,
# randomized model checks, the tests that wait seconds by design, or the emulator's own tests
# (`testground`: MongoDB's spec tests, plain PyMongo; `make test` runs them). One emulator serves the run, as in `make test`.
FAST ?= not broker and not crash and not model and not slow and not faults and not testground
test-fast: $(BIN)/.installed
	$(BIN)/python -m pytest $(PARALLEL) -m '$(FAST)' $(PYTEST_ARGS)

# The whole suite on Python 3.10; the MongoDB emulator (Python >= 3.13) runs from .venv. The tests
# of the emulator itself (`testground`: its transactions, MongoDB's spec tests) run once, in `make
# test`: this leg starts the same emulator from the same .venv, so they would check it twice. The
# relay's model check and the RabbitMQ confirm window's search the same interleavings on any
# Python: this leg runs a quarter of their examples (every rule and assertion still runs on
# 3.10), `make test` all of them.
OLDEST_MODEL_EXAMPLES ?= 25
OLDEST_VENV := .venv-oldest
$(OLDEST_VENV)/bin/.installed: pyproject.toml
	@test -n "$(OLDEST)" || { echo "error: Python 3.10 not found (set OLDEST=...)" >&2; exit 1; }
	test -x $(OLDEST_VENV)/bin/python || $(OLDEST) -m venv $(OLDEST_VENV)
	$(OLDEST_VENV)/bin/pip install -q -e '.[rabbitmq,nats,redis,cli,console,otel,prometheus,faststream,testing,beanie,mongoengine,odmantic,django]' 'faststream[rabbit,nats,redis,kafka]' 'pytest>=8,<9' pytest-asyncio pytest-timeout pytest-xdist hypothesis 'cloudevents>=2.2' motor pyyaml blinker httpx playwright \
		opentelemetry-sdk 'opentelemetry-test-utils>=0.41b0'
	touch $@

test-oldest: $(BIN)/.installed $(OLDEST_VENV)/bin/.installed
	MONGOECO_PYTHON=$(abspath $(BIN)/python) RELAY_MODEL_EXAMPLES=$(OLDEST_MODEL_EXAMPLES) \
		CONFIRM_WINDOW_EXAMPLES=$$(( $(OLDEST_MODEL_EXAMPLES) * 5 )) \
		$(OLDEST_VENV)/bin/python -m pytest $(PARALLEL) -m 'not testground' $(PYTEST_ARGS)

# The whole suite under coverage.py, for the line-coverage figure of mongo_outbox (in-process only).
coverage: $(BIN)/.installed
	COVERAGE_CORE=sysmon $(BIN)/python -m pytest --cov=mongo_outbox --cov-report=term $(PYTEST_ARGS)

# The whole suite against docker-compose.yml's replica set, RabbitMQ, NATS and Redis (started,
# healthy, and left running: `docker compose down` stops them). REPLSET_TEST=test-oldest runs it on
# Python 3.10; REPLSET_SERVICES=mongodb starts only MongoDB, for brokers you already run.
REPLSET_URI ?= mongodb://127.0.0.1:27017/?directConnection=true
REPLSET_TEST ?= test
REPLSET_SERVICES ?=
test-replset:
	docker compose up -d --wait $(REPLSET_SERVICES)
	MONGODB_URI='$(REPLSET_URI)' $(MAKE) $(REPLSET_TEST)

lint: $(BIN)/.installed
	$(BIN)/ruff check mongo_outbox tests examples benchmarks
	$(BIN)/ruff format --check mongo_outbox tests examples benchmarks

typecheck: $(BIN)/.installed
	$(BIN)/mypy
	$(BIN)/mypy --strict --explicit-package-bases examples benchmarks --exclude examples/django_shop
	# A Django project imports its apps from its own folder (run.py puts it on sys.path).
	cd examples/django_shop && ../../$(BIN)/mypy --strict --explicit-package-bases .

check: lint typecheck test

demo: $(BIN)/.installed
	$(BIN)/python examples/order_service.py

bench: $(BIN)/.installed
	$(BIN)/python -m benchmarks.run

# The fault matrix (tests/integration/faults/test_fault_matrix.py): each command the library
# sends under each of MongoDB's fault classes, printed as a table with its counts
# (docs/failures.md).
faults: $(BIN)/.installed
	$(BIN)/python -m tests.faults $(PYTEST_ARGS)

# The documentation site (mkdocs.yml) from docs/ into site/. --strict fails the build on any
# warning: a broken link or #anchor, or a docstring the API reference cannot parse. The docs
# extra comes with the dev extras; NO_MKDOCS_2_WARNING silences Material's end-of-life banner.
docs: $(BIN)/.installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) .venv-oldest .pytest_cache .mypy_cache .ruff_cache site
