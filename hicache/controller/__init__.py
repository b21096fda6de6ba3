"""The async side of hicache: the cache facade, prefetch lifecycle, the release queue."""

from __future__ import annotations

from hicache.controller.breaker import BreakerState, BreakerStatistics, CircuitBreaker
from hicache.controller.cache import CacheStatistics, HiCache, Lease
from hicache.controller.prefetch import Prefetch, PrefetchOutcome, PrefetchState
from hicache.controller.release import ComponentTransfer, ReleaseBatch, ReleaseQueue, ReleaseStatistics

__all__ = [
    "BreakerState",
    "BreakerStatistics",
    "CacheStatistics",
    "CircuitBreaker",
    "ComponentTransfer",
    "HiCache",
    "Lease",
    "Prefetch",
    "PrefetchOutcome",
    "PrefetchState",
    "ReleaseBatch",
    "ReleaseQueue",
    "ReleaseStatistics",
]
