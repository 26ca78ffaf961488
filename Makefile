# One entry point. `make run` runs the service on the local RabbitMQ and PostgreSQL;
# `make test` runs lint, type checks and the whole test suite. Both set themselves up.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
LOCK := deploy/requirements.lock
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml $(LOCK) | sha1sum | cut -c1-12)
# The lock's pins without their hashes, as pip constraints: the virtualenv runs the very versions
# the image installs (pip's hash checking cannot take an editable install).
CONSTRAINTS := $(VENV)/constraints.txt

.PHONY: run test lint typecheck pytest docs services tools migrate topology install dist lock \
	pin-base-image clean

$(STAMP): pyproject.toml $(LOCK)
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python 3.11 or newer is needed (set PYTHON=...)")'
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install --quiet --upgrade pip
	@sed -e '/^ *--hash=/d' -e 's/ *\\$$//' $(LOCK) > $(CONSTRAINTS)
	@$(PY) -m pip install --quiet -c $(CONSTRAINTS) -e '.[dev,deploy,bench]'
	@rm -f $(VENV)/.installed-*
	@touch $@

install: $(STAMP)

services:
	@deploy/local/services.sh

tools:
	@deploy/local/tools.sh

migrate: install services
	@$(VENV)/bin/consumer migrate --create-database

topology: install services
	@$(VENV)/bin/consumer topology apply

run: migrate topology
	@exec $(VENV)/bin/consumer run

# `make dist`: the wheel to install elsewhere (README: "Use it in your project"), built in a
# build environment of its own, .venv-dist: setuptools alone, at the lock's pin, not the
# development virtualenv (hundreds of MB for a wheel of 100 KB). Built with no isolated build
# (nothing fetched unpinned) from a clean build folder (a stale build/ would carry deleted files
# into the wheel). DIST_DIR=... puts the wheel elsewhere.
DIST_VENV ?= .venv-dist
DIST_DIR ?= dist

dist:
	@test -x $(DIST_VENV)/bin/python || $(PYTHON) -m venv $(DIST_VENV)
	@sed -e '/^ *--hash=/d' -e 's/ *\\$$//' $(LOCK) > $(DIST_VENV)/constraints.txt
	@$(DIST_VENV)/bin/python -m pip install --quiet -c $(DIST_VENV)/constraints.txt setuptools
	@rm -rf build
	@$(DIST_VENV)/bin/python -m pip wheel --quiet --no-deps --no-build-isolation \
	    --wheel-dir $(DIST_DIR) .
	@rm -rf build
	@ls $(DIST_DIR)/rabbit_pg_consumer-*.whl

# `make lock`: deploy/requirements.lock, what the image installs (with --require-hashes): the
# runtime dependencies of pyproject.toml and the wheel's build backend (its image-build group),
# pinned for the image's Python, 3.11 on Linux, each with the hashes of all of its files on PyPI.
# It takes the newest releases within pyproject's ranges (LOCK_ARGS= keeps the current pins where
# they still fit). Run it after changing a dependency, and to take security releases; then
# `make test` (the virtualenv follows the lock) and commit both files.
LOCK_ARGS ?= --upgrade

lock:
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install --quiet 'uv>=0.9,<1'
	@$(VENV)/bin/uv pip compile pyproject.toml --group image-build $(LOCK_ARGS) \
	    --generate-hashes --python-version 3.11 --python-platform linux \
	    --custom-compile-command 'make lock' --quiet --output-file $(LOCK)
	@grep -c '^[a-z]' $(LOCK) | xargs printf '%s: %s packages pinned\n' $(LOCK)

# `make pin-base-image`: deploy/Dockerfile's FROM lines to the digest python:3.11-slim names today
# (crane, skopeo or docker buildx, and a reachable registry). The base image moves only when this
# runs: then rebuild, `make test`, and commit the Dockerfile. BASE_TAG=... pins another tag.
pin-base-image:
	@deploy/local/pin-base-image.sh

# lint-imports: the layers and the no-circle rule of pyproject's [tool.importlinter].
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports --no-cache

typecheck: install
	$(VENV)/bin/mypy

# Three workers, one test file each at a time (pytest-xdist): most tests wait on a broker, a
# database or a child process (two workers kept the two cores about half busy: 27 minutes), and
# every test owns its names, so three run side by side. The files are handed out longest first
# (tests/schedule.py; xdist's own reordering, most tests first, is off): the chaos profile's file
# starts at once, beside the rest, not last. PYTEST_ARGS='-k retry' runs in-process.
PYTEST_ARGS ?= --numprocesses 3 --dist loadfile

pytest: install services tools
	$(VENV)/bin/pytest $(PYTEST_ARGS)

# `make docs`: the documentation site (mkdocs.yml, docs/) into site/, every warning an error: a
# broken link, a page missing from the nav, an anchor that is not there.
docs: install
	@NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

# The checks (lint, typecheck, docs: a minute of CPU on a clean clone, mypy without its cache) run
# beside the tests, on the cores the tests leave idle while they wait on the broker, instead of a
# minute before them; their output is printed as one block when they end, and either failing
# fails `make test`.
test: install services tools
	@log=$$(mktemp); status=0; \
	{ $(MAKE) --no-print-directory lint typecheck docs >"$$log" 2>&1; code=$$?; cat "$$log"; \
	  exit $$code; } & checks=$$!; \
	$(MAKE) --no-print-directory pytest || status=$$?; \
	wait $$checks || status=$$?; rm -f "$$log"; exit $$status

# `make bench` / `make soak`: see bench/README.md. BENCH_EVENTS, BENCH_RUNS, SOAK_EVENTS and the
# service's CONSUMER_* settings come from the environment; more flags in BENCH_ARGS / SOAK_ARGS.
# The bench extra (Celery, Dramatiq, psycopg 3) comes with `make install`: the unit tests compare
# the benchmark's messages with what Celery's and Dramatiq's own clients build.
# `make bench-queues`: the queue table's figures (README "Several queues in one service"):
# throughput and p99 at prefetch 1, 10, 400 x a handler awaiting 0, 5 ms, 2 s; its own target, as
# `make bench` already runs for most of an hour. More flags in BENCH_QUEUES_ARGS.
# `make bench-outbox`: the outbox relay's commit-to-confirmed latency at 500 and 1,000 rows/s and
# its top throughput from a backlog (a minute or two); more flags in BENCH_OUTBOX_ARGS.
# `make bench-shards`: sharded queues on a throwaway three-node cluster (README "Scale: shards,
# processes, nodes"): 1, 3 and 6 processes x 1, 3 and 6 shards, the same events, in one run
# (about ten minutes); more flags in BENCH_SHARDS_ARGS. It needs RabbitMQ's package (for the
# throwaway nodes).
.PHONY: bench bench-queues bench-outbox bench-shards soak

bench: install services
	@$(PY) -m bench run $(BENCH_ARGS)

bench-queues: install services
	@$(PY) -m bench.queue_rows $(BENCH_QUEUES_ARGS)

bench-outbox: install services
	@$(PY) -m bench.outbox $(BENCH_OUTBOX_ARGS)

bench-shards: install services
	@$(PY) -m bench.shards $(BENCH_SHARDS_ARGS)

soak: install services
	@$(PY) -m bench soak $(SOAK_ARGS)

# `make chaos`: the chaos suite's long profile (`make chaos PROFILE=short` for the quick one that
# `make test` also runs); tests/chaos/README.md. More flags in CHAOS_ARGS. The table goes to
# tests/chaos/results/. It needs RabbitMQ's and PostgreSQL's packages (for throwaway servers).
.PHONY: chaos
PROFILE ?= long

chaos: install services
	@$(PY) -m tests.chaos --profile $(PROFILE) $(CHAOS_ARGS)

clean:
	rm -rf $(VENV) $(DIST_VENV) .mypy_cache .pytest_cache .ruff_cache build dist site
