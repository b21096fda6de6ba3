"""The async side of hicache: the cache facade, prefetch lifecycle, the release queue."""

from __future__ import annotations

from hicache.controller.cache import CacheStatistics, HiCache, Lease
from hicache.controller.prefetch import Prefetch, PrefetchOutcome, PrefetchState
from hicache.controller.release import ComponentTransfer, ReleaseBatch, ReleaseQueue, ReleaseStatistics

__all__ = [
    "CacheStatistics",
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
