# Every target runs inside .venv, which `make setup` creates (Python 3.13, nemo-gym 0.7.0, this plugin).
PY := .venv/bin/python
PORT_BASE ?= 18000

.PHONY: setup test test-fast fuzz demo demo-s3 serve bench lint typecheck clean

setup:
	@./scripts/setup.sh

# Two pytest-xdist workers, each taking a whole test file at a time (a module's shared deployment starts once);
# TEST_WORKERS=0 runs everything in this one process, in file order. The slowest 30 are listed at the end.
TEST_WORKERS ?= 2
PARALLEL := -n $(TEST_WORKERS) --dist loadfile

test: setup
	$(PY) -m pytest $(PARALLEL) --durations=30

# The in-process tests only (no real server processes, marked `slow`): the quick lane while working.
test-fast: setup
	$(PY) -m pytest -m "not slow" $(PARALLEL)

# The property tests with fresh examples each run (CI draws the same ones every time: tests/conftest.py).
PROPERTY_TESTS := tests/test_attempts.py tests/test_control_stateful.py tests/test_fuzz_routes.py \
	tests/test_identity.py tests/test_routes_limits.py tests/test_storage_codec.py tests/test_storage_fuzz.py \
	tests/test_storage_pipeline.py
# Then FUZZ_SEQUENCES random sequences of the real-process machines (tests/fuzz_processes.py: a deployment
# driven through the coordination library, and ng-checkpoint collect killed at random); each violation is
# printed with its seed (FUZZ_SEED=<seed> FUZZ_SEQUENCES=1 make fuzz replays it). The last line is
# `fuzz: N sequences, K violations`; the status is non-zero when the property tests or a sequence failed.
# FUZZ_JOBS lanes run sequences side by side, each a process with its own zygote, deployments and ports;
# 2 by default, the fastest measured on this 2-core machine (docs/development.md).
FUZZ_SEQUENCES ?= 1000
FUZZ_JOBS ?= 2
fuzz: setup
	@status=0; HYPOTHESIS_PROFILE=explore $(PY) -m pytest -m "not slow" $(PROPERTY_TESTS) || status=1; \
	FUZZ_SEQUENCES=$(FUZZ_SEQUENCES) FUZZ_JOBS=$(FUZZ_JOBS) $(PY) tests/fuzz_processes.py || status=1; exit $$status

# PORT_BASE reaches the demo only when set (environment or `make demo PORT_BASE=N`); unset, it picks free ports.
# NUM_WORKERS=N (the demo's --num-workers): the model, resources and environment servers with N uvicorn workers.
# TOKEN_CAPTURE=1 (the demo's --token-capture): Gym's token capture on, and the capture invariant checked.
demo: setup
	$(if $(NUM_WORKERS),NUM_WORKERS=$(NUM_WORKERS)) $(if $(TOKEN_CAPTURE),TOKEN_CAPTURE=$(TOKEN_CAPTURE)) \
		exec $(PY) -m nemo_gym_checkpoint_plugin.testing.demo

# The same story with every checkpoint in a local S3-compatible server (moto on 127.0.0.1, started for the run).
demo-s3: setup
	exec $(PY) -m nemo_gym_checkpoint_plugin.testing.demo --local-s3

# exec: make's shell would otherwise stand between make and serve, and a SIGTERM to `make serve`
# (which make forwards to its recipe) would kill only that shell and leave every server running.
# NUM_WORKERS=N: the model, resources and environment servers with N uvicorn workers (unset: one each).
serve: setup
	PORT_BASE=$(PORT_BASE) $(if $(NUM_WORKERS),NUM_WORKERS=$(NUM_WORKERS)) exec $(PY) -m nemo_gym_checkpoint_plugin.testing.serve

bench: setup
	$(PY) benchmarks/storage.py
	$(PY) benchmarks/storage_s3.py
	$(PY) benchmarks/mid_turn.py

# What CI runs first (.ci/run): ruff, then mypy (about 25 s from a cold cache here, 3 s warm).
lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	./scripts/typecheck.sh

# mypy (pyproject's [tool.mypy]) over the package as installed (scripts/typecheck.sh says why it needs links).
typecheck: setup
	./scripts/typecheck.sh

clean:
	rm -rf .venv .pytest_cache .hypothesis .mypy_cache build/typecheck
