# Every target runs inside .venv, which `make setup` creates (Python 3.13, nemo-gym 0.7.0, this plugin).
PY := .venv/bin/python
PORT_BASE ?= 18000

.PHONY: setup test demo serve bench lint clean

setup:
	@./scripts/setup.sh

test: setup
	$(PY) -m pytest

demo: setup
	$(PY) -m nemo_gym_checkpoint_plugin.testing.demo

serve: setup
	PORT_BASE=$(PORT_BASE) $(PY) -m nemo_gym_checkpoint_plugin.testing.serve

bench: setup
	$(PY) benchmarks/storage.py

lint: setup
	$(PY) -m ruff check .

clean:
	rm -rf .venv .pytest_cache .hypothesis
