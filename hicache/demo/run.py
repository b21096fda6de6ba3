"""The phases of a demo run after its model is built: the cached run, the no-cache run, verification.

`run_serving` opens the cache over the storage tier (a temporary file-backend directory by default), serves
the workload through a runner's `ServingLoop`, snapshots the cache, serves the same prompts again with full
recompute and runs the runner's bitwise checks; every runner (Llama, hybrid) ends here.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from hicache.components.base import Component
from hicache.config import HiCacheConfig
from hicache.controller import HiCache
from hicache.demo.loop import ServingLoop
from hicache.demo.records import DemoConfig, DemoResult
from hicache.demo.snapshot import pool_json, sum_metric, top_prefixes
from hicache.keys import Namespace
from hicache.memory import KVLayout
from hicache.metrics import render as render_metrics
from hicache.metrics import snapshot as metrics_snapshot
from hicache.policy import StopPolicy
from storage_backends.cancellation import run_in_thread
from storage_backends.redact import redact_url

__all__ = ["demo_cache_config", "intra_op_threads", "run_serving", "storage_url"]


@contextlib.asynccontextmanager
async def storage_url(url: str | None) -> AsyncIterator[str]:
    """`async with storage_url(url) as url:` the URL itself, or a temporary file-backend directory when `None`."""
    if url is not None:
        yield url
        return
    with tempfile.TemporaryDirectory(prefix="hicache-demo-") as tmp:
        yield Path(tmp).as_uri()


def demo_cache_config(
    config: DemoConfig,
    layout: KVLayout,
    url: str,
    model_name: str,
    components: tuple[Component, ...] = (),
) -> HiCacheConfig:
    """The cache's configuration for a demo run: `config`'s pools and policies over `url`.

    Args:
        config: the run's configuration.
        layout: the base pool's (full-attention) K/V layout.
        url: the storage URL actually used.
        model_name: the namespace's model name.
        components: the hybrid model's components, if any.
    """
    return HiCacheConfig(
        layout=layout,
        device_pages=config.device_pages,
        host_pages=config.host_pages,
        write_policy=config.write_policy,
        storage_url=url,
        storage_options=config.storage_options,
        # A fresh namespace per run: pages a previous run left in a shared store are not this run's
        # model output as far as the oracle knows, so they must never match.
        namespace=Namespace(model_id=model_name, extra=uuid.uuid4().hex),
        prefetch_threshold=config.prefetch_threshold,
        # In lockstep a prefetch loads every page it can, however slow the machine: hits stay reproducible.
        prefetch_stop_policy=StopPolicy.WAIT_COMPLETE if config.lockstep else StopPolicy.TIMEOUT,
        components=components,
    )


async def run_serving(
    runner: ServingLoop[Any],
    config: DemoConfig,
    cache_config: Callable[[str], HiCacheConfig],
    wall: dict[str, float],
    announce: Callable[[str], None] | None = None,
    inspect: Callable[[HiCache], dict[str, Any]] | None = None,
) -> DemoResult:
    """The phases of a demo run after the model is built: cached run, no-cache run, verification.

    Args:
        runner: the run's serving loop.
        config: the run's configuration (storage tier, metrics port).
        cache_config: the cache's configuration, given the storage URL actually used.
        wall: seconds per phase so far; the `cache`, `recompute` and `verify` phases are added.
        announce: called with the metrics URL once it is being served.
        inspect: called with the cache at the end of the cached run; what it returns becomes the result's
            `details`.
    """
    with intra_op_threads(config.torch_threads):  # a no-op when the caller already set it
        try:
            return await _serve_phases(runner, config, cache_config, wall, announce, inspect)
        finally:
            # Shielded: a cancelled run (Ctrl-C, a deadline) would otherwise raise at the call's first
            # checkpoint, before `close` ran, and leave the model thread waiting for work forever.
            await run_in_thread(runner.worker.close)


class _Listening:
    """Where `serve_metrics` reports its bound port."""

    def __init__(self) -> None:
        self.port: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    def started(self, value: int) -> None:
        self.port.set_result(value)


@contextlib.contextmanager
def intra_op_threads(threads: int | None) -> Iterator[None]:
    """Set torch's intra-op threads for the calling thread (the event loop's) and for threads yet to start.

    Entered before the model is built, so that no worker thread starts with torch's default.

    The cache's pool reads and writes run on the event loop thread; left at torch's default there (one
    thread per core), each small gather or scatter starts an OpenMP team, which on a loaded two-core
    machine waits milliseconds for cores the model's worker thread is using (a 12 KiB state slot read
    measured 3 ms instead of 16 us). `None` leaves torch's setting alone.
    """
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if threads is not None:
            torch.set_num_threads(before)


async def _serve_phases(
    runner: ServingLoop[Any],
    config: DemoConfig,
    cache_config: Callable[[str], HiCacheConfig],
    wall: dict[str, float],
    announce: Callable[[str], None] | None,
    inspect: Callable[[HiCache], dict[str, Any]] | None,
) -> DemoResult:
    metrics_url: str | None = None
    details: dict[str, Any] = {}
    async with storage_url(config.backend_url) as url:
        hicache_config = cache_config(url)
        async with HiCache(hicache_config) as cache, asyncio.TaskGroup() as tg:
            metrics_server: asyncio.Task[None] | None = None
            if config.metrics_port is not None:
                from hicache.metrics import serve_metrics

                listening = _Listening()
                metrics_server = tg.create_task(
                    serve_metrics(cache.registry, "127.0.0.1", config.metrics_port, task_status=listening)
                )
                port = await listening.port
                metrics_url = f"http://127.0.0.1:{port}/metrics"
                if announce is not None:
                    announce(metrics_url)
            t = runner.t0 = time.perf_counter()
            await runner.serve_cached(cache)
            await cache.wait_idle()
            wall["cache"] = time.perf_counter() - t
            cache.sanity_check()
            snapshot = metrics_snapshot(cache.registry)
            prometheus = render_metrics(cache.registry)
            stats = cache.statistics()
            pools = {
                "device": pool_json(stats.device_pool),
                "host": pool_json(stats.host_pool),
                "storage": {
                    "url": redact_url(url),
                    "bytes_written": sum_metric(snapshot, "storage_written_bytes_total"),
                },
            }
            tree = {
                "nodes": stats.tree.num_nodes,
                "device_tokens": stats.tree.device_tokens,
                "host_tokens": stats.tree.host_tokens,
                "evictable_device_tokens": stats.tree.evictable_device_tokens,
                "evictable_host_tokens": stats.tree.evictable_host_tokens,
            }
            if inspect is not None:
                details = inspect(cache)
            prefixes = top_prefixes(cache)
            if metrics_server is not None:
                metrics_server.cancel()
    t = runner.t0 = time.perf_counter()
    await runner.serve_recompute()
    wall["recompute"] = time.perf_counter() - t
    t = time.perf_counter()
    await runner.compute(runner.verify)
    wall["verify"] = time.perf_counter() - t
    return DemoResult(
        config=config,
        backend_url=redact_url(url),
        records=runner.records,
        metrics=snapshot,
        prometheus=prometheus,
        pools=pools,
        tree=tree,
        top_prefixes=prefixes,
        wall_s=wall,
        token_nbytes=hicache_config.layout.token_nbytes,
        metrics_url=metrics_url,
        details=details,
    )
