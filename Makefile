# Two entry points: `make serve` runs the embedded stack, `make test` runs the tests.
# Both create .venv when missing. CPU torch comes first so pip never pulls a CUDA build here.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0

.PHONY: serve test venv install test-all clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[test,bench]'
	touch $@

install: $(VENV)/.installed

serve: install
	$(BIN)/deepserve up

test: install
	$(BIN)/python -m pytest -q

test-all: install
	$(BIN)/python -m pytest -q -m 'not gpu'

clean:
	rm -rf $(VENV) build *.egg-info
