"""`bench/bench_faults.py --put`, the file backend's put micro-run, runs in each of its layouts and reports
what its docstring says: CPU and wall time per page over the puts only, and with `--put-root` the pages
stay under the root it was given (so `strace -c` over two sizes counts the puts alone).

Guards the instrument issue 25's write-path figures come from (BENCHMARKS.md) against rotting unseen:
`--smoke` (tests/test_benches_smoke.py) does not run it. The figures mean nothing here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = 100
"""Not a multiple of the batch: the last put is a short one."""


def put_micro_run(*args: str) -> dict[str, object]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_faults.py"), "--put", str(PAGES), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    summary: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return summary


@pytest.mark.timeout(150)
@pytest.mark.parametrize("layout", ["backend", "files", "links", "group"])
def test_the_put_micro_run_reports_cpu_and_wall_per_page_in_each_layout(layout: str, tmp_path: Path) -> None:
    """Each layout writes every page under the kept root and reports its per-page figures."""
    root = tmp_path / "pages"
    summary = put_micro_run("--put-batch", "64", "--put-root", str(root), "--put-layout", layout)
    assert summary["bench"] == "faults_put"
    assert (summary["layout"], summary["pages"], summary["batch"]) == (layout, PAGES, 64)
    for key in ("sys_us_per_page", "user_us_per_page", "wall_us_per_page"):
        assert isinstance(summary[key], float | int), key
        assert summary[key] >= 0, key
    names = list(root.glob("??/*.kvp"))
    if layout == "group":  # one file per put, no name per page
        assert not names
        assert len(list(root.glob("??/group-*.kvg"))) == 2
    else:
        assert len(names) == PAGES
    assert not list(root.glob("??/.*.tmp")), "a temporary file was left behind"
