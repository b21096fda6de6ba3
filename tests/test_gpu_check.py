"""`bench/gpu_check.sh`, the one prepared script a lent GPU machine runs, checked end to end on the CPU.

Device time is scarce (minutes per task), so the script must not fail there for a reason this machine could
have caught: a test module importing what the GPU image lacks, or a C extension built for another Python.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_gpu_check_dry_run_builds_the_extension_tests_and_benchmarks(tmp_path: Path) -> None:
    env = dict(
        os.environ,
        PYTHON=sys.executable,
        GPU_CHECK_DRY_RUN="1",
        OUT=str(tmp_path / "out"),
        GPU_CHECK_SITE=str(tmp_path / "site"),
        GPU_CHECK_VENV=str(tmp_path / "venv"),
    )
    done = subprocess.run(
        ["bash", "bench/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert done.returncode == 0, summary
    assert "native build" in (tmp_path / "out" / "native.log").read_text()
    assert list((tmp_path / "site").glob("_hicache_native*")), "the extension was not built for this Python"
    assert "CUDA tests were skipped" not in summary
    benches = [json.loads(line)["bench"] for line in summary.splitlines() if line.startswith('{"bench"')]
    assert benches == ["transfer", "io", "layerwise"]
