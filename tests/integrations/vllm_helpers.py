"""Helpers of the vLLM connector tests and `bench/bench_vllm.py`: the interpreter of the vLLM environment,
a runner for `vllm_workload.py` (one engine per process) and the comparisons of its results.

vLLM pins `transformers<5.20`, which lacks the hybrid model `hicache demo --model hybrid` needs, so vLLM lives
in an environment of its own (`make venv-vllm`: `.venv-vllm`, hicache installed there with the `[vllm]`
extra). The tests run in the project's environment and start every engine with that interpreter
(`HICACHE_VLLM_PYTHON` overrides it). A missing environment fails the tests: CI must never skip them.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

ENGINE_TIMEOUT_S = 900


def vllm_python() -> str:
    """The interpreter of the vLLM environment (`HICACHE_VLLM_PYTHON`, else `.venv-vllm/bin/python`)."""
    path = os.environ.get("HICACHE_VLLM_PYTHON", str(ROOT / ".venv-vllm" / "bin" / "python"))
    if not Path(path).exists():
        pytest.fail(f"no vLLM environment at {path}: run `make venv-vllm` (or set HICACHE_VLLM_PYTHON)")
    return path


def run_workload(out: Path, *args: str, extra_env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run one engine over the workload (`vllm_workload.py ARGS`) and return its JSON result."""
    env = dict(os.environ)
    env.update({"PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1"})
    env.update(extra_env or {})
    log = out.with_suffix(".log")
    with log.open("wb") as sink:
        proc = subprocess.run(
            [vllm_python(), str(HERE / "vllm_workload.py"), "--out", str(out), *args],
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=env,
            timeout=ENGINE_TIMEOUT_S,
            check=False,
        )
    if proc.returncode != 0:
        tail = log.read_text(errors="replace")[-6000:]
        pytest.fail(f"engine run {args} exited {proc.returncode}:\n{tail}")
    result: dict[str, Any] = json.loads(out.read_text())
    result["log"] = str(log)
    return result


def assert_identical(expected: dict[str, Any], got: dict[str, Any], tolerance: float = 1e-4) -> None:
    """Every request's tokens equal, and its logprobs within `tolerance`."""
    assert len(expected["requests"]) == len(got["requests"])
    for i, (a, b) in enumerate(zip(expected["requests"], got["requests"], strict=True)):
        assert a["token_ids"] == b["token_ids"], f"request {i}: tokens differ"
        diff = max((abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"], strict=True)), default=0.0)
        assert diff <= tolerance, f"request {i}: logprobs differ by {diff}"


def hit_tokens(result: dict[str, Any], tier: str) -> int:
    return sum(int(r["hits"][tier]) for r in result["requests"])
