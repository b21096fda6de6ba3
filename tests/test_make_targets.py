"""The Makefile's benchmark targets: `make bench` runs every script in `bench/`, and the README names them."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH_NAMES = sorted(p.stem.removeprefix("bench_") for p in (ROOT / "bench").glob("bench_*.py"))


def test_every_bench_script_is_found() -> None:
    """Guards the test below against passing on an empty list."""
    assert {"tree", "io", "tp", "layerwise", "refill"} <= set(BENCH_NAMES)


def test_make_bench_runs_every_bench_script() -> None:
    """Guards against `make bench` leaving scripts out (it ran six of nine: not tp, layerwise, refill)."""
    dry_run = subprocess.run(
        ["make", "-n", "bench"], cwd=ROOT, capture_output=True, text=True, check=True, timeout=60
    ).stdout
    ran = re.findall(r"python bench/bench_(\w+)\.py", dry_run)
    assert sorted(ran) == BENCH_NAMES
    assert len(ran) == len(set(ran)), "a script runs twice"


def test_the_readme_names_every_bench_target() -> None:
    """The README's sentence on `make bench` lists every `make bench-NAME` there is."""
    readme = (ROOT / "README.md").read_text()
    found = re.search(r"`make bench` runs every\s+benchmark in `bench/`.*?\((.*?); results in", readme, re.S)
    assert found is not None, "the README no longer says what `make bench` runs"
    listed = re.findall(r"`(\w+)`", found.group(1))
    assert sorted(listed) == BENCH_NAMES
