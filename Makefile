# The two commands: `make up` starts the system on the embedded default models,
# `make test` runs the whole test suite. Both install what they need first.
PY ?= python3

.PHONY: install up test test-fast protos bench

install:
	./scripts/install.sh

up: install
	specdec up

test: install
	$(PY) scripts/gen_protos.py --check
	$(PY) -m pytest tests

test-fast: install
	$(PY) -m pytest tests -m "not slow"

protos:
	$(PY) scripts/gen_protos.py
