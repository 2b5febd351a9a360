# Two entry points: `make serve` runs the embedded stack, `make test` runs the tests.
# Both create .venv when missing. CPU torch comes first so pip never pulls a CUDA build here;
# every other package is pinned by requirements.lock (pip constraints; `make lock` refreshes it).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
LOCK := requirements.lock

.PHONY: serve test venv install test-all lock clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml $(LOCK)
	$(BIN)/pip install -q -c $(LOCK) $(TORCH)
	$(BIN)/pip install -q -c $(LOCK) -e '.[test,bench]'
	touch $@

install: $(VENV)/.installed

serve: install
	$(BIN)/deepserve up

test: install
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=15

test-all: install
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m 'not gpu'

# Re-resolve every dependency from pyproject.toml in a scratch venv and write the pins.
lock:
	rm -rf .lock-venv
	$(PY) -m venv .lock-venv
	.lock-venv/bin/pip install -q --upgrade pip
	.lock-venv/bin/pip install -q $(TORCH)
	.lock-venv/bin/pip install -q -e '.[test,bench]'
	{ sed -n '/^#/p' $(LOCK); .lock-venv/bin/pip freeze --exclude-editable | sed 's/+cpu$$//'; } > $(LOCK).new
	mv $(LOCK).new $(LOCK)
	rm -rf .lock-venv

clean:
	rm -rf $(VENV) build *.egg-info
