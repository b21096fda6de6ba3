"""What the demo reads off the cache at the end of its cached run: metric sums, pool occupancy, top prefixes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from hicache.controller import HiCache
from hicache.tree import TreeNode

__all__ = ["pool_json", "sum_metric", "top_prefixes"]


def sum_metric(snapshot: dict[str, dict[str, Any]], name: str) -> float:
    """The sum over label sets of the counter `name` (with or without a prefix such as `hicache_`).

    Returns 0 when no such metric was registered.
    """
    for full, metric in snapshot.items():
        if full == name or full.endswith("_" + name):
            return float(sum(s["value"] for s in metric.get("samples", []) if "value" in s))
    return 0.0


def _subtree(node: TreeNode) -> Iterator[TreeNode]:
    stack = [node]
    while stack:
        current = stack.pop()
        yield current
        stack.extend(current.children.values())


def top_prefixes(cache: HiCache, limit: int = 8) -> list[dict[str, Any]]:
    """The tree's top-level branches (one per distinct first page, e.g. per system prompt), most hit first."""
    rows: list[dict[str, Any]] = []
    # A debugging view that walks the cache's private tree: the tree has no query for its branches yet.
    for child in cache._tree.root.children.values():
        nodes = list(_subtree(child))
        rows.append(
            {
                "first_tokens": [
                    int(t) for t in torch.frombuffer(bytearray(child.key[:64]), dtype=torch.int64)
                ],
                "edge_tokens": child.num_tokens,
                "hits": child.hit_count,
                "nodes": len(nodes),
                "device_tokens": sum(n.num_tokens for n in nodes if n.device_value is not None),
                "host_tokens": sum(n.num_tokens for n in nodes if n.host_value is not None),
            }
        )
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
