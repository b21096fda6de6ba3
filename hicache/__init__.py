"""hicache: a hierarchical KV-cache controller for LLM serving loops.

A paged radix tree over device, pinned host and storage tiers, embedded in asyncio serving loops.
"""

from __future__ import annotations

from hicache.components import MambaState, SlidingWindow
from hicache.config import HiCacheConfig
from hicache.controller import (
    CacheStatistics,
    ComponentTransfer,
    HiCache,
    Lease,
    Prefetch,
    PrefetchOutcome,
    PrefetchState,
)
from hicache.errors import (
    CacheClosed,
    ChecksumMismatch,
    HiCacheError,
    InvariantViolation,
    PageNotFound,
    PoolError,
    PrefetchError,
    PrefetchFailed,
    StorageError,
    StorageUnavailable,
    UnknownRequest,
)
from hicache.keys import Namespace
from hicache.memory import KVLayout, KVPool
from hicache.policy import EvictionPolicy, StopPolicy, WritePolicy
from hicache.tree import RadixTree

__all__ = [
    "CacheClosed",
    "CacheStatistics",
    "ChecksumMismatch",
    "ComponentTransfer",
    "EvictionPolicy",
    "HiCache",
    "HiCacheConfig",
    "HiCacheError",
    "InvariantViolation",
    "KVLayout",
    "KVPool",
    "Lease",
    "MambaState",
    "Namespace",
    "PageNotFound",
    "PoolError",
    "Prefetch",
    "PrefetchError",
    "PrefetchFailed",
    "PrefetchOutcome",
    "PrefetchState",
    "RadixTree",
    "SlidingWindow",
    "StopPolicy",
    "StorageError",
    "StorageUnavailable",
    "UnknownRequest",
    "WritePolicy",
]
