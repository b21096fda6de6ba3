"""Fixtures for the vLLM connector tests: the tiny model, the directory of engine runs, and the workload
on vLLM alone that every scenario is compared with (helpers: `vllm_helpers.py`)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_model import write_tiny_llama
from vllm_helpers import run_workload


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama (config.json and tokenizer.json, no weights: vLLM loads dummy weights)."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def engine_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine-runs")


@pytest.fixture(scope="session")
def baseline(tiny_model: Path, engine_runs: Path) -> dict[str, Any]:
    """The workload on vLLM alone (prefix caching on, its KV space small enough to evict)."""
    return run_workload(engine_runs / "baseline.json", "--model", str(tiny_model))
