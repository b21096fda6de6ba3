"""The pure, synchronous radix tree core: matching, inserting, splitting, locking and eviction choice.

It imports neither the pools nor anyio: nothing here awaits or touches memory beyond index tensors.
Callers hold `NodeRef` handles; the nodes themselves (`hicache.tree.node`) are the tree's own records.
"""

from __future__ import annotations

from hicache.tree.handles import ComponentInfo, HeldIndices, NodeInfo, NodeRef, StoredPath
from hicache.tree.radix import RadixTree
from hicache.tree.results import (
    EMPTY_INDICES,
    BranchStatistics,
    ComponentEvictResult,
    ComponentFree,
    ComponentStatistics,
    EvictResult,
    FreeResult,
    HostEvictResult,
    InsertResult,
    LoadResult,
    MatchResult,
    PrefixPeek,
    TreeStatistics,
)

__all__ = [
    "EMPTY_INDICES",
    "BranchStatistics",
    "ComponentEvictResult",
    "ComponentFree",
    "ComponentInfo",
    "ComponentStatistics",
    "EvictResult",
    "FreeResult",
    "HeldIndices",
    "HostEvictResult",
    "InsertResult",
    "LoadResult",
    "MatchResult",
    "NodeInfo",
    "NodeRef",
    "PrefixPeek",
    "RadixTree",
    "StoredPath",
    "TreeStatistics",
]
