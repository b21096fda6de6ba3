"""The async side of hicache: the `HiCache` facade and its collaborators (allocation, tier moves, prefetch
admission and lifecycle, leases, accounting, background workers), the circuit breaker, the release queue."""

from __future__ import annotations

from hicache.controller.breaker import BreakerState, BreakerStatistics, CircuitBreaker
from hicache.controller.cache import HiCache
from hicache.controller.prefetch import Prefetch, PrefetchOutcome, PrefetchState
from hicache.controller.release import ComponentTransfer, ReleaseBatch, ReleaseQueue, ReleaseStatistics
from hicache.controller.results import CacheStatistics, ComponentPoolStatistics, Lease

__all__ = [
    "BreakerState",
    "BreakerStatistics",
    "CacheStatistics",
    "CircuitBreaker",
    "ComponentPoolStatistics",
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
