# The front door: `make run` (the main job) and `make test` (the tests). Both set up .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test check bench bench-tree bench-io bench-s3 venv clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# The CPU build of torch first, so the project's torch range installs nothing more (no CUDA wheel).
	$(BIN)/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
	$(BIN)/python -m pip install -q --disable-pip-version-check -e ".[test,dev]"
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(BIN)/hicache demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

check: $(STAMP)
	$(BIN)/ruff check hicache storage_backends tests bench examples
	$(BIN)/ruff format --check hicache storage_backends tests bench examples
	$(BIN)/mypy

bench: bench-tree bench-io bench-s3

bench-tree: $(STAMP)
	$(BIN)/python bench/bench_tree.py

bench-io: $(STAMP)
	$(BIN)/python bench/bench_io.py

bench-s3: $(STAMP)
	$(BIN)/python bench/bench_s3.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
