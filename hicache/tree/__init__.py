"""The pure, synchronous radix tree core: matching, inserting, splitting, locking and eviction choice."""

from __future__ import annotations

from hicache.tree.eviction import LeafSet
from hicache.tree.node import TreeNode
from hicache.tree.radix import RadixTree
from hicache.tree.results import (
    EMPTY_INDICES,
    ComponentStatistics,
    EvictResult,
    HostEvictResult,
    InsertResult,
    MatchResult,
    TreeStatistics,
)

__all__ = [
    "EMPTY_INDICES",
    "ComponentStatistics",
    "EvictResult",
    "HostEvictResult",
    "InsertResult",
    "LeafSet",
    "MatchResult",
    "RadixTree",
    "TreeNode",
    "TreeStatistics",
]
