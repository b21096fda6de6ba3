"""Showing a registry: Prometheus text (prometheus_client's `generate_latest`), a JSON-ready snapshot, and
``/metrics`` over HTTP (prometheus_client's own server), with multiprocess mode handled.

Multiprocess mode is prometheus_client's: when ``PROMETHEUS_MULTIPROC_DIR`` names a directory in every
process's environment before it imports prometheus_client, each process (a tensor-parallel rank) writes its
values to files there, and `scrape_registry` reads them all back for exposition.
"""

from __future__ import annotations

import asyncio
import math
import os
import threading
from typing import Any, Protocol

import prometheus_client as prom
from prometheus_client import multiprocess

from storage_backends.cancellation import run_in_thread, uncancellable

__all__ = ["multiprocess_dir", "render", "scrape_registry", "serve_metrics", "snapshot"]


class _TaskStatus(Protocol):
    """What `serve_metrics` tells the bound port through (anyio's `TaskStatus` fits)."""

    def started(self, value: int) -> None: ...


def multiprocess_dir() -> str | None:
    """The multiprocess directory prometheus_client uses in this process's environment, if any."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


def scrape_registry(registry: prom.CollectorRegistry) -> prom.CollectorRegistry:
    """What to expose for `registry`: itself, or in multiprocess mode every process's values.

    In multiprocess mode the values live in the directory's files, so this is a fresh registry holding a
    `MultiProcessCollector` over it (prometheus_client's prescribed way; `registry` itself would show
    only this process's values).
    """
    path = multiprocess_dir()
    if path is None:
        return registry
    merged = prom.CollectorRegistry()
    multiprocess.MultiProcessCollector(merged, path=path)  # type: ignore[no-untyped-call]  # unannotated
    return merged


def render(registry: prom.CollectorRegistry) -> str:
    """`registry` in Prometheus text exposition format 0.0.4 (prometheus_client's `generate_latest`)."""
    return prom.generate_latest(registry).decode("utf-8")


def _bound(value: float) -> str:
    return "+Inf" if math.isinf(value) else repr(float(value))


def snapshot(registry: prom.CollectorRegistry) -> dict[str, dict[str, Any]]:
    """Every metric of `registry` as plain JSON-serialisable data, keyed by its exposed name.

    A counter or gauge: ``{"type", "help", "samples": [{"labels", "value"}]}``; a histogram's samples
    are ``{"labels", "buckets": {"0.1": cumulative count, ..., "+Inf": n}, "sum", "count"}``. The
    ``_created`` timestamps prometheus_client adds are left out.
    """
    out: dict[str, dict[str, Any]] = {}
    for family in registry.collect():
        if family.type == "counter":
            name = family.name + "_total"
            samples: list[dict[str, Any]] = [
                {"labels": dict(s.labels), "value": s.value} for s in family.samples if s.name == name
            ]
        elif family.type == "histogram":
            name = family.name
            series: dict[tuple[tuple[str, str], ...], dict[str, Any]] = {}
            for s in family.samples:
                labels = {k: v for k, v in s.labels.items() if k != "le"}
                entry = series.setdefault(
                    tuple(sorted(labels.items())), {"labels": labels, "buckets": {}, "sum": 0.0, "count": 0}
                )
                if s.name == name + "_bucket":
                    entry["buckets"][_bound(float(s.labels["le"]))] = int(s.value)
                elif s.name == name + "_sum":
                    entry["sum"] = s.value
                elif s.name == name + "_count":
                    entry["count"] = int(s.value)
            samples = list(series.values())
        else:
            name = family.name
            samples = [{"labels": dict(s.labels), "value": s.value} for s in family.samples if s.name == name]
        out[name] = {"type": family.type, "help": family.documentation, "samples": samples}
    return out


async def serve_metrics(
    registry: prom.CollectorRegistry,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    task_status: _TaskStatus | None = None,
) -> None:
    """Serve `registry` (through `scrape_registry`) with prometheus_client's HTTP server until cancelled.

    Run it as a task; `task_status.started(port)` is called once it listens (so anyio's
    ``port = await task_group.start(serve_metrics, registry)`` learns the bound port). The
    server runs in prometheus_client's own thread; cancelling this task shuts it down and waits for it.

    Args:
        registry: the metrics to serve.
        host: the address to bind; loopback by default.
        port: the port to bind; 0 picks a free one.
        task_status: receives the bound port once listening (None: nobody asks).
    """
    exposed = scrape_registry(registry)
    server, thread = await run_in_thread(lambda: prom.start_http_server(port, host, exposed))
    try:
        if task_status is not None:
            task_status.started(int(server.server_address[1]))
        await asyncio.get_running_loop().create_future()  # until cancelled
    finally:
        await uncancellable(_shut_down(server, thread))


async def _shut_down(server: Any, thread: threading.Thread) -> None:
    await run_in_thread(server.shutdown)
    server.server_close()
    await run_in_thread(thread.join)
