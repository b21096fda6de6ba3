"""hicache: a hierarchical KV-cache controller for LLM serving loops.

A paged radix tree over device, pinned host and storage tiers, embedded in asyncio serving loops. The names
below are the public API: `HiCache` and its configuration, what it hands back (leases, prefetch outcomes,
insert and match results, statistics), the storage backend protocol, the errors it raises and the enums
that name tiers and outcomes. Everything else is reachable only through a leading underscore or a
submodule, and may change.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
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
    from hicache.controller.movement.layered_load import LayerwiseLoad
    from hicache.errors import (
        CacheClosed,
        CacheFailed,
        ChecksumMismatch,
        ForeignPage,
        HiCacheError,
        InvariantViolation,
        LeaseReleased,
        LoadBackFailed,
        OldPageFormat,
        PageNotFound,
        PoolError,
        StorageAuthError,
        StorageCircuitOpen,
        StorageError,
        StorageUnavailable,
        UnknownRequest,
        UnsupportedEventLoop,
    )
    from hicache.keys import Namespace
    from hicache.layout import KVLayout
    from hicache.memory import KVPool, PoolStatistics
    from hicache.memory.layerwise import LayerReadiness
    from hicache.policy import EvictionPolicy, RefillPolicy, StopPolicy, WritePolicy
    from hicache.tiers import DropReason, PrefetchStatus, ShedReason, SkipReason, Tier
    from hicache.tree import ComponentStatistics, InsertResult, MatchResult, NodeRef, TreeStatistics
    from storage_backends.protocol import PageStatus, StorageBackend

# Public names load their module on first use (PEP 562), so importing a submodule (`hicache.tree`,
# `hicache.keys`, `hicache.layout`, `hicache.components`) does not import the controller, the pools or anyio.
_MODULE_OF = {
    "BreakerState": "hicache.controller",
    "BreakerStatistics": "hicache.controller",
    "CacheClosed": "hicache.errors",
    "CacheFailed": "hicache.errors",
    "CacheStatistics": "hicache.controller",
    "ChecksumMismatch": "hicache.errors",
    "CircuitBreaker": "hicache.controller",
    "ComponentPoolStatistics": "hicache.controller",
    "ComponentStatistics": "hicache.tree",
    "ComponentTransfer": "hicache.controller",
    "DropReason": "hicache.tiers",
    "EvictionPolicy": "hicache.policy",
    "ForeignPage": "hicache.errors",
    "HiCache": "hicache.controller",
    "HiCacheConfig": "hicache.config",
    "HiCacheError": "hicache.errors",
    "InsertResult": "hicache.tree",
    "InvariantViolation": "hicache.errors",
    "KVLayout": "hicache.layout",
    "KVPool": "hicache.memory",
    "LayerReadiness": "hicache.memory.layerwise",
    "LayerwiseLoad": "hicache.controller.movement.layered_load",
    "Lease": "hicache.controller",
    "LeaseReleased": "hicache.errors",
    "LoadBackFailed": "hicache.errors",
    "MambaState": "hicache.components",
    "MatchResult": "hicache.tree",
    "Namespace": "hicache.keys",
    "NodeRef": "hicache.tree",
    "OldPageFormat": "hicache.errors",
    "PageNotFound": "hicache.errors",
    "PageStatus": "storage_backends.protocol",
    "PoolError": "hicache.errors",
    "PoolStatistics": "hicache.memory",
    "Prefetch": "hicache.controller",
    "PrefetchOutcome": "hicache.controller",
    "PrefetchState": "hicache.controller",
    "PrefetchStatus": "hicache.tiers",
    "RefillPolicy": "hicache.policy",
    "ReleaseStatistics": "hicache.controller",
    "ShedReason": "hicache.tiers",
    "SkipReason": "hicache.tiers",
    "SlidingWindow": "hicache.components",
    "StopPolicy": "hicache.policy",
    "StorageAuthError": "hicache.errors",
    "StorageBackend": "storage_backends.protocol",
    "StorageCircuitOpen": "hicache.errors",
    "StorageError": "hicache.errors",
    "StorageUnavailable": "hicache.errors",
    "Tier": "hicache.tiers",
    "TreeStatistics": "hicache.tree",
    "UnknownRequest": "hicache.errors",
    "UnsupportedEventLoop": "hicache.errors",
    "WritePolicy": "hicache.policy",
}

__all__ = [
    "BreakerState",
    "BreakerStatistics",
    "CacheClosed",
    "CacheFailed",
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
    "LayerReadiness",
    "LayerwiseLoad",
    "Lease",
    "LeaseReleased",
    "LoadBackFailed",
    "MambaState",
    "MatchResult",
    "Namespace",
    "NodeRef",
    "OldPageFormat",
    "PageNotFound",
    "PageStatus",
    "PoolError",
    "PoolStatistics",
    "Prefetch",
    "PrefetchOutcome",
    "PrefetchState",
    "PrefetchStatus",
    "RefillPolicy",
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
    "UnsupportedEventLoop",
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
