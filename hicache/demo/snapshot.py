"""What the demo reads off the cache at the end of its cached run: metric sums, pool occupancy, top prefixes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from hicache.controller import HiCache
from hicache.tree import NodeInfo, NodeRef, RadixTree

__all__ = ["pool_json", "sum_metric", "top_prefixes"]


def sum_metric(snapshot: dict[str, dict[str, Any]], name: str) -> float:
    """The sum over label sets of the counter `name` (with or without a prefix such as `hicache_`).

    Returns 0 when no such metric was registered.
    """
    for full, metric in snapshot.items():
        if full == name or full.endswith("_" + name):
            return float(sum(s["value"] for s in metric.get("samples", []) if "value" in s))
    return 0.0


def _subtree(tree: RadixTree, node: NodeRef) -> Iterator[NodeInfo]:
    stack = [node]
    while stack:
        info = tree.node_info(stack.pop())
        yield info
        stack.extend(info.children)


def top_prefixes(cache: HiCache, limit: int = 8) -> list[dict[str, Any]]:
    """The tree's top-level branches (one per distinct first page, e.g. per system prompt), most hit first."""
    # A debugging view of the cache's private tree, read through the tree's node snapshots.
    tree = cache._tree
    rows: list[dict[str, Any]] = []
    for child in tree.node_info(tree.root).children:
        nodes = list(_subtree(tree, child))
        top = nodes[0]
        rows.append(
            {
                "first_tokens": [
                    int(t) for t in torch.frombuffer(bytearray(top.key[:64]), dtype=torch.int64)
                ],
                "edge_tokens": top.num_tokens,
                "hits": top.hit_count,
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
