"""hicache: a hierarchical KV-cache controller for LLM serving loops.

A paged radix tree over device, pinned host and storage tiers, embedded in asyncio serving loops. The names
below are the public API: `HiCache` and its configuration, what it hands back (leases, prefetch outcomes,
insert and match results, statistics), the storage backend protocol, the errors it raises and the enums
that name tiers and outcomes. Everything else is reachable only through a leading underscore or a
submodule, and may change.
"""

from __future__ import annotations

from hicache.components import MambaState, SlidingWindow
from hicache.config import HiCacheConfig
from hicache.controller import (
    BreakerState,
    BreakerStatistics,
    CacheStatistics,
    CircuitBreaker,
    ComponentPoolStatistics,
    ComponentTransfer,
    HiCache,
    Lease,
    Prefetch,
    PrefetchOutcome,
    PrefetchState,
    ReleaseStatistics,
)
from hicache.errors import (
    CacheClosed,
    ChecksumMismatch,
    ForeignPage,
    HiCacheError,
    InvariantViolation,
    OldPageFormat,
    PageNotFound,
    PoolError,
    StorageAuthError,
    StorageCircuitOpen,
    StorageError,
    StorageUnavailable,
    UnknownRequest,
)
from hicache.keys import Namespace
from hicache.memory import KVLayout, KVPool, PoolStatistics
from hicache.policy import EvictionPolicy, StopPolicy, WritePolicy
from hicache.tiers import DropReason, PrefetchStatus, ShedReason, SkipReason, Tier
from hicache.tree import ComponentStatistics, InsertResult, MatchResult, TreeStatistics
from storage_backends.protocol import PageStatus, StorageBackend

__all__ = [
    "BreakerState",
    "BreakerStatistics",
    "CacheClosed",
    "CacheStatistics",
    "ChecksumMismatch",
    "CircuitBreaker",
    "ComponentPoolStatistics",
    "ComponentStatistics",
    "ComponentTransfer",
    "DropReason",
    "EvictionPolicy",
    "ForeignPage",
    "HiCache",
    "HiCacheConfig",
    "HiCacheError",
    "InsertResult",
    "InvariantViolation",
    "KVLayout",
    "KVPool",
    "Lease",
    "MambaState",
    "MatchResult",
    "Namespace",
    "OldPageFormat",
    "PageNotFound",
    "PageStatus",
    "PoolError",
    "PoolStatistics",
    "Prefetch",
    "PrefetchOutcome",
    "PrefetchState",
    "PrefetchStatus",
    "ReleaseStatistics",
    "ShedReason",
    "SkipReason",
    "SlidingWindow",
    "StopPolicy",
    "StorageAuthError",
    "StorageBackend",
    "StorageCircuitOpen",
    "StorageError",
    "StorageUnavailable",
    "Tier",
    "TreeStatistics",
    "UnknownRequest",
    "WritePolicy",
]
