"""What the demo reads off the cache at the end of its cached run: metric sums, pool occupancy, top prefixes."""

from __future__ import annotations

from typing import Any

import torch

from hicache.controller import HiCache
from hicache.keys import TOKEN_BYTES

__all__ = ["pool_json", "sum_metric", "top_prefixes"]


def sum_metric(snapshot: dict[str, dict[str, Any]], name: str) -> float:
    """The sum over label sets of the counter `name` (with or without a prefix such as `hicache_`).

    Returns 0 when no such metric was registered.
    """
    for full, metric in snapshot.items():
        if full == name or full.endswith("_" + name):
            return float(sum(s["value"] for s in metric.get("samples", []) if "value" in s))
    return 0.0


def top_prefixes(cache: HiCache, limit: int = 8) -> list[dict[str, Any]]:
    """The tree's top-level branches (one per distinct first page, e.g. per system prompt), most hit first."""
    # A debugging view of the cache's private tree, read through the tree's branch query.
    rows: list[dict[str, Any]] = [
        {
            "first_tokens": [int(t) for t in torch.frombuffer(bytearray(b.key[:64]), dtype=torch.int64)],
            "edge_tokens": len(b.key) // TOKEN_BYTES,
            "hits": b.hits,
            "nodes": b.nodes,
            "device_tokens": b.device_tokens,
            "host_tokens": b.host_tokens,
        }
        for b in cache._tree.branches()
    ]
    rows.sort(key=lambda r: (-int(r["hits"]), -int(r["nodes"])))
    return rows[:limit]


def pool_json(stats: Any) -> dict[str, Any]:
    """A pool's `PoolStatistics` as JSON-serialisable data."""
    return {
        "device": stats.device,
        "capacity_pages": stats.capacity_pages,
        "used_pages": stats.used_pages,
        "free_pages": stats.free_pages,
        "page_size": stats.page_size,
        "page_nbytes": stats.page_nbytes,
    }
