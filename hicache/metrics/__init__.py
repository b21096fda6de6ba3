"""The cache's metrics as prometheus_client collectors, in a registry the caller passes.

`default_cache_metrics` registers the controller's metric set (`CacheMetrics`) in a
`prometheus_client.CollectorRegistry`; `HiCache(config, metrics=registry)` does it for the cache, so an
embedding server's ``/metrics`` shows hicache's series (default: a registry of the cache's own). The
handles (`Counter`, `Gauge`, `Histogram`) keep the controller's call style over prometheus_client's
collectors. `render`, `snapshot` and `serve_metrics` show a registry; multi-process serving (one process per
tensor-parallel rank) uses prometheus_client's multiprocess mode, see `hicache.metrics.exposition`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from hicache.metrics.cache_metrics import (
    DEFAULT_PREFIX,
    LATENCY_BUCKETS,
    CacheMetrics,
    default_cache_metrics,
    rank_labels,
)
from hicache.metrics.exposition import multiprocess_dir, render, scrape_registry, serve_metrics, snapshot
from hicache.metrics.handles import Counter, Gauge, Histogram

__all__ = [
    "DEFAULT_PREFIX",
    "LATENCY_BUCKETS",
    "CacheMetrics",
    "CollectorRegistry",
    "Counter",
    "Gauge",
    "Histogram",
    "default_cache_metrics",
    "multiprocess_dir",
    "rank_labels",
    "render",
    "scrape_registry",
    "serve_metrics",
    "snapshot",
]
