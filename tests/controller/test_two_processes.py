"""Two processes share KV through the file backend: one serves and writes through, a fresh one loads.

Process A serves three prompts (two sharing a prefix) with a `HiCache` over ``file://tmp``: each page goes
device -> host -> storage in the background; A waits idle, dumps the device KV and exits. Process B, a
fresh interpreter with nothing in memory, acquires the same prompts: every full page comes from storage
and the loaded bytes equal A's originals (and the oracle). B with another model's namespace reads the same
directory and gets no hit at all.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

WORKER = Path(__file__).with_name("two_process_worker.py")


def run_worker(role: str, root: Path, model: str, out: Path) -> dict[str, Any]:
    """Run one side in a fresh interpreter (warnings are errors there too) and return its JSON line."""
    proc = subprocess.run(
        [sys.executable, "-W", "error", str(WORKER), role, str(root), model, str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Warning" not in proc.stderr, proc.stderr
    assert "Exception ignored" not in proc.stderr, proc.stderr
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, Any]]:
    """Process A has served the prompts under model "llama-a" and exited."""
    root = tmp_path_factory.mktemp("pages")
    out = tmp_path_factory.mktemp("originals")
    return root, out, run_worker("serve", root, "llama-a", out)


def test_a_fresh_process_loads_the_bytes_the_first_one_wrote(
    served: tuple[Path, Path, dict[str, Any]],
) -> None:
    """B prefetches every full page from storage; its device KV equals A's originals, page for page."""
    root, out, serve = served
    # 10 + 9 + 8 full pages, 6 of them shared: 21 distinct pages of 256 bytes on disk.
    assert len(list(root.rglob("*.kvp"))) == 21
    assert serve["bytes_written"] == 21 * 256
    load = run_worker("load", root, "llama-a", out)
    first, second, third = load["results"]
    for r in load["results"]:
        assert r["cached"] == r["aligned"]
        assert r["equal_original"]
        assert r["equal_oracle"]
    assert first["tiers"] == {"device": 0, "host": 0, "storage": 40}
    assert second["tiers"] == {"device": 24, "host": 0, "storage": 12}  # the shared prefix is on device
    assert third["tiers"] == {"device": 0, "host": 0, "storage": 32}


def test_another_models_namespace_gets_no_hits_from_the_same_directory(
    served: tuple[Path, Path, dict[str, Any]],
) -> None:
    """Same tokens, same directory, another model: every lookup misses; nothing is loaded."""
    root, out, _ = served
    load = run_worker("load", root, "llama-b", out)
    for r in load["results"]:
        assert r["cached"] == 0
        assert r["tiers"] == {"device": 0, "host": 0, "storage": 0}
    assert load["skipped"] == ['hicache_prefetch_skipped_total{reason="storage_miss"} 3.0']
