# The README's two commands: `make train` and `make test`. Each builds .venv in the checkout (idempotent).
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
PIP     := $(BIN)/python -m pip --disable-pip-version-check -q

.PHONY: train test bench bench-suite setup clean

# Reinstall when the project metadata or pins change; otherwise reuse the venv.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) install -c constraints.txt -e ".[dev,jax]"
	touch $(STAMP)

setup: $(STAMP)

train: $(STAMP)
	$(BIN)/python -m fxtrain.train $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest fxtrain tests $(ARGS)

bench: $(STAMP)
	$(BIN)/python experiments/bench/step.py $(ARGS)

bench-suite: $(STAMP)
	$(BIN)/python experiments/bench/suite.py --threads 2 $(ARGS)

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache
