"""The async side of hicache: the `HiCache` facade and the rooms it is built from.

- `cache`, `leases`, `results`, `state`, `workers`, `accounting`: the facade itself (what a serving loop
  calls, its start and close, what it shows of itself), matching and holding requests' prefixes, what it
  hands back, whether it is open, its background task, and the ownership check `sanity_check()` runs.
- `prefetch`: storage -> host prefetches, admission to commit or drop.
- `movement`: device <-> host backups and load-backs.
- `storage`: host <-> storage, behind the tier's circuit breaker.
- `pages`: allocation with eviction, and the release queue.

Each room may call only the rooms listed after it here (`prefetch` -> `movement` -> `storage` ->
`pages`) and `state` (whether the cache is open); the facade calls them all.
"""

from __future__ import annotations

from hicache.controller.cache import HiCache
from hicache.controller.pages.release import ComponentTransfer, ReleaseBatch, ReleaseQueue, ReleaseStatistics
from hicache.controller.prefetch.job import Prefetch, PrefetchOutcome, PrefetchState
from hicache.controller.results import CacheStatistics, ComponentPoolStatistics, Lease
from hicache.controller.storage.guarded import BreakerState, BreakerStatistics, CircuitBreaker

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
