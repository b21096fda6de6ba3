#!/usr/bin/env bash
# The GPU check: CUDA tests and device<->host benchmarks on a machine with an NVIDIA GPU, in one go.
#
#   bash bench/gpu_check.sh                  # on the GPU machine, from the repo root
#   bash bench/gpu_check.sh --fetch-wheels   # beforehand, on a machine that reaches the package registry:
#                                            # puts the pure-Python wheels the GPU image lacks into .whl/
#
# On the GPU machine it
#   1. finds a Python whose torch sees CUDA (the image's own python3 holds a CUDA torch): no venv, no
#      `make venv` (that installs the CPU wheel), no `pip install -e .` (a build needs setuptools from a
#      registry); the repo goes on PYTHONPATH instead. Modules missing there (pytest-asyncio, prometheus_client)
#      are installed from .whl/*.whl into a scratch folder, or else from a registry if one answers.
#      Only if no Python with a CUDA torch exists does it make a venv and pip-install torch into it
#      (TORCH_SPEC, default torch==2.13.0: a CUDA build on Linux x86_64), time-bounded;
#   2. builds the C extension for that Python with gcc (into the scratch folder, ahead of the repo), runs
#      `pytest -m cuda` over the test files that carry CUDA tests, then tests/memory, and fails if the
#      CUDA tests were skipped;
#   3. runs bench/bench_transfer.py (defaults: 4 GiB per pass with CUDA), then
#      bench/bench_io.py --total-mib 1024 --repeats 2 (its host pool is pinned with CUDA), then
#      bench/bench_layerwise.py (its Llama-8B-shaped defaults with CUDA), even when the tests failed.
#
# Everything goes under $OUT (default ./gpu-out): summary.txt, env.txt, setup.log, native.log,
# pytest-cuda.log, pytest-memory.log, bench_transfer.log, bench_io.log, bench_layerwise.log. The whole run
# keeps within GPU_CHECK_BUDGET_S seconds (default 540); each step gets at most its own limit and what is
# left of that budget.
# GPU_CHECK_DRY_RUN=1 checks the script itself on a machine without a GPU: a CPU torch is accepted,
# skipped CUDA tests are not a failure, and the benchmarks move 64 MiB once (no SGLang baseline).
# Exit status: 0 all passed; 1 setup or tests failed (no CUDA, a missing module, a failed or skipped
# CUDA test); 3 only a benchmark failed or ran out of time.
set -u -o pipefail

cd "$(dirname "$0")/.." || exit 1
WHEELS=.whl

if [[ ${1:-} == --fetch-wheels ]]; then
    # Pure-Python wheels, so one download serves any CPython 3 on the GPU machine.
    mkdir -p "$WHEELS"
    python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: -d "$WHEELS" \
        "pytest-asyncio==1.5.0" "prometheus_client==0.26.0" || exit 1
    ls -l "$WHEELS"/*.whl
    exit 0
fi

OUT=${OUT:-./gpu-out}
mkdir -p "$OUT" || exit 1
BUDGET_S=${GPU_CHECK_BUDGET_S:-540}
DRY_RUN=${GPU_CHECK_DRY_RUN:-0}
SITE=${GPU_CHECK_SITE:-/tmp/hicache-gpu-site}
VENV=${GPU_CHECK_VENV:-/tmp/hicache-gpu-venv}
START=$(date +%s)
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
: >"$OUT/summary.txt"

log() { echo "[gpu_check +$(($(date +%s) - START))s] $*" | tee -a "$OUT/summary.txt"; }
left() { echo $((BUDGET_S - ($(date +%s) - START))); }

# step NAME LIMIT_S CMD...: run CMD with output to $OUT/NAME.log, under min(LIMIT_S, budget left).
step() {
    local name=$1 limit=$2 remain t0 rc
    shift 2
    remain=$(left)
    if ((remain < 20)); then
        log "$name: not run, ${remain}s left of the ${BUDGET_S}s budget"
        return 124
    fi
    ((limit > remain)) && limit=$remain
    log "$name: start, limit ${limit}s: $*"
    t0=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    log "$name: exit $rc after $(($(date +%s) - t0))s"
    tail -n 15 "$OUT/$name.log"
    return $rc
}

has_cuda_torch() { "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; }

# Import name -> package name of what the tests and benchmarks import.
missing_modules() {
    "$PY" - <<'EOF'
import importlib.util

needed = {
    "anyio": "anyio", "prometheus_client": "prometheus_client", "xxhash": "xxhash", "numpy": "numpy", "pytest": "pytest",
    "pytest_asyncio": "pytest-asyncio", "pytest_timeout": "pytest-timeout", "hypothesis": "hypothesis",
}
print(" ".join(pkg for mod, pkg in needed.items() if importlib.util.find_spec(mod) is None))
EOF
}

setup_fail=0
{
    echo "== nvidia-smi"
    timeout 30 nvidia-smi || echo "nvidia-smi failed or is missing (exit $?)"
    echo "== uname"
    uname -a
} >"$OUT/env.txt" 2>&1
log "gpu: $(timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -1)"

# 1. A Python with a CUDA torch.
PY=""
for cand in ${PYTHON:-} python3 /opt/torch/.venv/bin/python3 python; do
    path=$(command -v "$cand" 2>/dev/null) || continue
    if has_cuda_torch "$path" || { ((DRY_RUN)) && "$path" -c 'import torch' >/dev/null 2>&1; }; then
        PY=$path
        break
    fi
done
if [[ -z $PY ]]; then
    log "no Python with a CUDA-enabled torch; installing ${TORCH_SPEC:-torch==2.13.0} into $VENV (needs a registry)"
    {
        python3 -m venv "$VENV" &&
            timeout 420 "$VENV/bin/python" -m pip install -q --disable-pip-version-check --retries 1 \
                --timeout 20 "${TORCH_SPEC:-torch==2.13.0}" anyio prometheus_client xxhash numpy pytest pytest-asyncio \
                pytest-timeout hypothesis
    } >>"$OUT/setup.log" 2>&1
    if has_cuda_torch "$VENV/bin/python"; then
        PY=$VENV/bin/python
    else
        setup_fail=1
        PY=$(command -v python3)
        [[ -x $VENV/bin/python ]] && "$VENV/bin/python" -c 'import torch' 2>/dev/null && PY=$VENV/bin/python
        log "FAIL: still no CUDA torch (see setup.log); the rest runs on $PY, on the CPU"
    fi
fi
log "python: $PY"

# Modules the image lacks: from the carried wheels first, then from a registry if one answers.
missing=$(missing_modules)
if [[ -n $missing ]] && compgen -G "$WHEELS/*.whl" >/dev/null; then
    wheels=("$WHEELS"/*.whl)
    log "missing: $missing; installing ${wheels[*]##*/} into $SITE"
    "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target "$SITE" "${wheels[@]}" >>"$OUT/setup.log" 2>&1 || log "wheel install failed (setup.log)"
    missing=$(missing_modules)
fi
if [[ -n $missing ]]; then
    log "missing: $missing; trying a registry (time-bounded)"
    # --no-deps: the image's own numpy, pytest, ... stay in charge; only the missing names are added.
    read -r -a names <<<"$missing"
    timeout 120 "$PY" -m pip install -q --disable-pip-version-check --no-deps --retries 0 --timeout 15 \
        --target "$SITE" "${names[@]}" >>"$OUT/setup.log" 2>&1 || log "registry install failed (setup.log)"
    missing=$(missing_modules)
fi
if [[ -n $missing ]]; then
    log "FAIL: still missing $missing (bash bench/gpu_check.sh --fetch-wheels here, then carry .whl)"
    setup_fail=1
fi

"$PY" - >>"$OUT/env.txt" 2>&1 <<'EOF'
import importlib.metadata as md
import platform
import torch

print("== python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", torch.cuda.get_device_name(0), f"{p.total_memory / 2**30:.0f} GiB", "sm", p.major, p.minor)
for name in ("anyio", "prometheus_client", "xxhash", "numpy", "pytest", "pytest-asyncio", "pytest-timeout", "hypothesis",
             "transformers", "obstore", "moto"):
    try:
        print(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name} -")
EOF
log "$(grep -m1 '^== python' "$OUT/env.txt")"

# The C extension, built here for this Python into $SITE (ahead of the repo on PYTHONPATH): a .so carried
# from another machine is for another Python or an older BUILD. gcc straight, no setuptools needed.
build_native() {
    local inc suffix
    inc=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])') &&
        suffix=$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))') &&
        mkdir -p "$SITE" &&
        ${CC:-gcc} -O3 -std=c11 -shared -fPIC -Inative -I"$inc" native/hicache_native.c native/xxh_dispatch.c \
            -o "$SITE/_hicache_native$suffix" -lpthread &&
        "$PY" -c 'import storage_backends.native as n; print("native build", n.BUILD)'
}
export -f build_native
export PY SITE
step native 120 bash -c build_native || {
    log "FAIL: cannot build the C extension (native.log: a C compiler and Python.h are needed)"
    setup_fail=1
}

# 2. Tests.
test_fail=$setup_fail
# Only the files that carry CUDA tests: the rest of the suite may import what this image lacks (obstore,
# transformers, matplotlib), and one collection error fails the whole run.
mapfile -t cuda_files < <(grep -rl --include='test_*.py' 'pytest.mark.cuda' tests | sort)
step pytest-cuda 150 "$PY" -m pytest -q -p no:cacheprovider -rs -m cuda "${cuda_files[@]}" || test_fail=1
if ((!DRY_RUN)) && grep -q "needs CUDA" "$OUT/pytest-cuda.log"; then
    log "FAIL: CUDA tests were skipped (torch sees no GPU)"
    test_fail=1
fi
step pytest-memory 180 "$PY" -m pytest -q -p no:cacheprovider -rs tests/memory || test_fail=1

# 3. Benchmarks, whatever the tests said.
bench_fail=0
transfer_args=() io_args=(--total-mib 1024 --repeats 2)
((DRY_RUN)) && transfer_args=(--total-mib 64 --repeats 1) io_args=(--total-mib 64 --repeats 1 --no-sglang)
step bench_transfer 240 "$PY" bench/bench_transfer.py ${transfer_args[@]+"${transfer_args[@]}"} || bench_fail=1
bench_dir=$(mktemp -d /tmp/hicache-bench-io-XXXXXX)
step bench_io 240 "$PY" bench/bench_io.py "${io_args[@]}" --dir "$bench_dir" || bench_fail=1
rm -rf "$bench_dir"
layerwise_args=()
((DRY_RUN)) && layerwise_args=(--repeats 1 --prefix 512 --suffix 16)
step bench_layerwise 120 "$PY" bench/bench_layerwise.py ${layerwise_args[@]+"${layerwise_args[@]}"} || bench_fail=1

for name in bench_transfer bench_io bench_layerwise; do
    [[ -f $OUT/$name.log ]] && grep -h '^{"bench"' "$OUT/$name.log" | tee -a "$OUT/summary.txt"
done
status=0
((bench_fail)) && status=3
((test_fail)) && status=1
log "done: setup $((setup_fail ? 1 : 0)), tests $((test_fail ? 1 : 0)) (1 = failed), benchmarks $bench_fail; exit $status"
exit $status
