# The README's two commands: `make train` and `make test`. Each builds .venv in the checkout (idempotent).
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
PIP     := $(BIN)/python -m pip --disable-pip-version-check -q

.PHONY: train test test-all docs studies matrix relayout bench bench-suite gpu-check setup clean

# Reinstall when the project metadata or pins change; otherwise reuse the venv.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) install -c constraints.txt -e ".[dev,jax]"
	touch $(STAMP)

setup: $(STAMP)

train: $(STAMP)
	$(BIN)/python -m fxtrain.train $(ARGS)

# pytest-xdist: one worker per core, at most 4 (each multi-rank test starts 2-4 processes of its own);
# --dist loadfile keeps a file in one worker, so module fixtures and worlds are set up once; --durations=15 prints
# the slowest 15 tests at the end (issue 36). TEST_WORKERS=0
# runs everything in one process (a debugger, -x on the first failure in file order).
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); echo $$(( n > 4 ? 4 : n )))

# `make test` is the fast suite (under 10 minutes on 2 cores): every behaviour, with the widest products cut to a
# cover. `make test-all` adds the tests marked slow (each beyond a cheaper test of the same behaviour) and runs
# tests/test_matrix.py's all-pairs cover instead of its every-value one.
PYTEST := $(BIN)/python -m pytest fxtrain tests -n $(TEST_WORKERS) --dist loadfile --durations=15

test: $(STAMP)
	$(PYTEST) -m "not slow" $(ARGS)

test-all: $(STAMP)
	FXTRAIN_MATRIX=pairwise FXTRAIN_SLOW=1 $(PYTEST) $(ARGS)

# The documentation site (mkdocs.yml, docs/) into site/, offline, warnings as errors: the pages, and the API reference
# generated from the package's docstrings (docs/_hooks.py). tests/test_docs.py builds it in the suite too.
# NO_MKDOCS_2_WARNING: mkdocs-material's banner about its successor, printed at every build.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict

# The committed studies (lr_sweep, jax_parity) rerun into a fresh directory and compared with their results.md
# (experiments/studies.py: tolerance, how to renew them). About 2 minutes on 2 cores.
studies: $(STAMP)
	$(BIN)/python experiments/studies.py $(ARGS)

# The whole layout x amp x accumulate x optimizer-kind x resume product of tests/test_matrix.py (the suite runs a
# pairwise subset), judged against one process, into experiments/matrix/results.md: commit it with the change that
# moved it. ARGS="--only 'parallel=pp,pp_tp;amp=bf16'" runs a slice (printed; --write writes it as the table).
matrix: $(STAMP)
	$(BIN)/python experiments/matrix/run.py --write $(ARGS)

# Every conf/parallel preset's checkpoint continued on every other (resume_relayout=true), into
# experiments/relayout/results.md (~15 min on 2 cores). ARGS="--out DIR --rerun ep_fsdp" keeps DIR's other runs.
relayout: $(STAMP)
	$(BIN)/python experiments/relayout/run.py --write $(ARGS)

bench: $(STAMP)
	$(BIN)/python experiments/bench/step.py $(ARGS)

bench-suite: $(STAMP)
	$(BIN)/python experiments/bench/suite.py --threads 2 $(ARGS)

# On a machine with CUDA (under 8 minutes): the `cuda` tests, the AMP table of the ResNet and tiny LM experiments
# and the vmapped-sweep speedup, into experiments/gpu/results/gpu_check.md. Without CUDA it skips in one line.
gpu-check: $(STAMP)
	$(BIN)/python experiments/gpu/check.py $(ARGS)

clean:
	rm -rf $(VENV) outputs multirun site .pytest_cache
