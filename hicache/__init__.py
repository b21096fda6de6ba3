"""hicache: a hierarchical KV-cache controller for LLM serving loops.

A paged radix tree over device, pinned host and storage tiers, embedded in asyncio serving loops.
"""

from __future__ import annotations

from hicache.components import MambaState, SlidingWindow
from hicache.config import HiCacheConfig
from hicache.controller import (
    BreakerState,
    CacheStatistics,
    CircuitBreaker,
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
    StorageAuthError,
    StorageError,
    StorageUnavailable,
    UnknownRequest,
)
from hicache.keys import Namespace
from hicache.memory import KVLayout, KVPool
from hicache.policy import EvictionPolicy, StopPolicy, WritePolicy
from hicache.tree import RadixTree

__all__ = [
    "BreakerState",
    "CacheClosed",
    "CacheStatistics",
    "ChecksumMismatch",
    "CircuitBreaker",
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
    "StorageAuthError",
    "StorageError",
    "StorageUnavailable",
    "UnknownRequest",
    "WritePolicy",
]
