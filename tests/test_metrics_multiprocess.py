"""Tensor-parallel ranks as real processes, in prometheus_client's multiprocess mode.

Two worker processes (`metrics_rank_worker.py`), each one rank with its own `HiCache` and file storage,
run with ``PROMETHEUS_MULTIPROC_DIR`` set and exit. This process then scrapes the directory the way an
embedding server does: through `scrape_registry` (a `MultiProcessCollector`) as text, and over HTTP from
`serve_metrics` on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
from metrics_helpers import http_get, scraped
from prometheus_client import multiprocess

from hicache.metrics import CollectorRegistry, render, scrape_registry, serve_metrics

WORKER = Path(__file__).with_name("metrics_rank_worker.py")
REPO = Path(__file__).resolve().parents[1]
PAGE = 4
TOKENS = {0: 8, 1: 12}  # rank -> prompt tokens: 2 and 3 pages


async def run_ranks(tmp_path: Path, tp_size: int) -> tuple[Path, list[dict[str, Any]]]:
    """Run both ranks at once as fresh interpreters sharing one multiprocess directory; their JSON lines."""
    mp_dir = tmp_path / "prometheus"
    mp_dir.mkdir()
    env = {
        **os.environ,
        "PROMETHEUS_MULTIPROC_DIR": str(mp_dir),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    results: dict[int, dict[str, Any]] = {}

    async def rank(r: int) -> None:
        root = tmp_path / f"storage-{r}"
        cmd = [sys.executable, "-W", "error", str(WORKER), str(r), str(tp_size), str(TOKENS[r]), str(root)]
        proc = await anyio.run_process(cmd, env=env, check=False)
        stderr = proc.stderr.decode()
        assert proc.returncode == 0, stderr
        assert "Warning" not in stderr, stderr
        results[r] = json.loads(proc.stdout.decode().strip().splitlines()[-1])

    async with anyio.create_task_group() as tg:
        for r in TOKENS:
            tg.start_soon(rank, r)
    return mp_dir, [results[r] for r in sorted(results)]


def merged(mp_dir: Path) -> CollectorRegistry:
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(mp_dir))  # type: ignore[no-untyped-call]
    return registry


async def test_each_rank_keeps_its_series_apart_in_one_scrape(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tp_size 2: every series carries `tp_rank`; one scrape of the directory shows both ranks' values,
    each what that rank's own registry showed; `serve_metrics` serves the same over HTTP; once a dead rank
    is marked, its live gauge goes and its counters stay."""
    mp_dir, (rank0, rank1) = await run_ranks(tmp_path, tp_size=2)
    page_nbytes = rank0["page_nbytes"]
    samples = scraped(render(merged(mp_dir)))
    for r, worker in ((0, rank0), (1, rank1)):
        label = (("tp_rank", str(r)),)
        assert samples[("hicache_backup_tokens_total", label)] == TOKENS[r]
        assert samples[("hicache_storage_written_bytes_total", label)] == TOKENS[r] // PAGE * page_nbytes
        assert samples[("hicache_storage_breaker_state", (("tier", "storage"), ("tp_rank", str(r))))] == 0.0
        own = worker["own"]["hicache_backup_tokens_total"]["samples"]
        assert own == [{"labels": {"tp_rank": str(r)}, "value": float(TOKENS[r])}]
    assert "_created" not in render(merged(mp_dir))  # not kept in multiprocess mode

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(mp_dir))
    own_registry = CollectorRegistry()
    assert scrape_registry(own_registry) is not own_registry
    async with anyio.create_task_group() as tg:
        port = await tg.start(serve_metrics, own_registry)
        _, _, body = await anyio.to_thread.run_sync(http_get, f"http://127.0.0.1:{port}/metrics")
        tg.cancel_scope.cancel()
    assert scraped(body) == samples

    multiprocess.mark_process_dead(rank1["pid"], path=str(mp_dir))  # type: ignore[no-untyped-call]
    after = scraped(render(merged(mp_dir)))
    assert ("hicache_storage_breaker_state", (("tier", "storage"), ("tp_rank", "1"))) not in after
    assert ("hicache_storage_breaker_state", (("tier", "storage"), ("tp_rank", "0"))) in after
    assert after[("hicache_backup_tokens_total", (("tp_rank", "1"),))] == TOKENS[1]


async def test_processes_without_a_rank_label_add_up(tmp_path: Path) -> None:
    """tp_size 1 in both processes (two data-parallel replicas, say): no `tp_rank`, counters summed."""
    mp_dir, (first, second) = await run_ranks(tmp_path, tp_size=1)
    samples = scraped(render(merged(mp_dir)))
    assert samples[("hicache_backup_tokens_total", ())] == sum(TOKENS.values())
    assert (
        samples[("hicache_storage_written_bytes_total", ())]
        == sum(TOKENS.values()) // PAGE * first["page_nbytes"]
    )
    assert samples[("hicache_prefetch_latency_seconds_count", ())] == 0.0
    assert first["pid"] != second["pid"]
