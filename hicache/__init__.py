"""hicache: a hierarchical KV-cache controller for LLM serving loops.

A paged radix tree over device, pinned host and storage tiers, embedded in asyncio serving loops.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
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
    from hicache.layout import KVLayout
    from hicache.memory import KVPool
    from hicache.policy import EvictionPolicy, StopPolicy, WritePolicy
    from hicache.tree import RadixTree

# Public names load their module on first use (PEP 562), so `import hicache.tree` (or keys, layout,
# components) does not import the controller, the pools or anyio.
_MODULE_OF = {
    "BreakerState": "hicache.controller",
    "CacheClosed": "hicache.errors",
    "CacheStatistics": "hicache.controller",
    "ChecksumMismatch": "hicache.errors",
    "CircuitBreaker": "hicache.controller",
    "ComponentTransfer": "hicache.controller",
    "EvictionPolicy": "hicache.policy",
    "HiCache": "hicache.controller",
    "HiCacheConfig": "hicache.config",
    "HiCacheError": "hicache.errors",
    "InvariantViolation": "hicache.errors",
    "KVLayout": "hicache.layout",
    "KVPool": "hicache.memory",
    "Lease": "hicache.controller",
    "MambaState": "hicache.components",
    "Namespace": "hicache.keys",
    "PageNotFound": "hicache.errors",
    "PoolError": "hicache.errors",
    "Prefetch": "hicache.controller",
    "PrefetchError": "hicache.errors",
    "PrefetchFailed": "hicache.errors",
    "PrefetchOutcome": "hicache.controller",
    "PrefetchState": "hicache.controller",
    "RadixTree": "hicache.tree",
    "SlidingWindow": "hicache.components",
    "StopPolicy": "hicache.policy",
    "StorageAuthError": "hicache.errors",
    "StorageError": "hicache.errors",
    "StorageUnavailable": "hicache.errors",
    "UnknownRequest": "hicache.errors",
    "WritePolicy": "hicache.policy",
}

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


def __getattr__(name: str) -> object:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'hicache' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
