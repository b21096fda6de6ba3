"""The pure, synchronous radix tree core: matching, inserting, splitting, locking and eviction choice.

It imports neither the pools nor anyio: nothing here awaits or touches memory beyond index tensors.
"""

from __future__ import annotations

from hicache.tree.handles import HeldIndices, NodeInfo, NodeRef, StoredPath
from hicache.tree.leaf_set import LeafSet
from hicache.tree.node import TreeNode
from hicache.tree.radix import RadixTree
from hicache.tree.results import (
    EMPTY_INDICES,
    ComponentFree,
    ComponentStatistics,
    EvictResult,
    HostEvictResult,
    InsertResult,
    LoadResult,
    MatchResult,
    PrefixPeek,
    TreeStatistics,
)

__all__ = [
    "EMPTY_INDICES",
    "ComponentFree",
    "ComponentStatistics",
    "EvictResult",
    "HeldIndices",
    "HostEvictResult",
    "InsertResult",
    "LeafSet",
    "LoadResult",
    "MatchResult",
    "NodeInfo",
    "NodeRef",
    "PrefixPeek",
    "RadixTree",
    "StoredPath",
    "TreeNode",
    "TreeStatistics",
]
