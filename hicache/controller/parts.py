"""The parts of a `HiCache` its mixins read: declared once, set by `HiCache.__init__`.

`CacheLifecycle` (start, close) and `CacheObservation` (statistics, repr, sanity check) are mixins of
`HiCache` that work on the cache's own state and collaborators; this base declares them for the type
checker, so neither mixin repeats the list.
"""

from __future__ import annotations

from hicache.config import HiCacheConfig
from hicache.controller.accounting import Accounting
from hicache.controller.movement.copies import CopyTracker
from hicache.controller.movement.tier_mover import TierMover
from hicache.controller.pages.allocation import ComponentPools
from hicache.controller.pages.release import ReleaseQueue
from hicache.controller.prefetch.prefetcher import Prefetcher
from hicache.controller.state import OpenState
from hicache.controller.storage.breaker import CircuitBreaker
from hicache.controller.workers import Workers
from hicache.memory import KVPool
from hicache.metrics import CacheMetrics
from hicache.parallel import Agreement
from hicache.tree import RadixTree
from storage_backends.protocol import StorageBackend

__all__ = ["CacheParts"]


class CacheParts:
    """The state and collaborators of a `HiCache` (all set by `HiCache.__init__`)."""

    config: HiCacheConfig
    page_size: int
    storage: StorageBackend | None
    storage_breaker: CircuitBreaker
    metrics: CacheMetrics
    agreement: Agreement | None
    _owns_storage: bool
    _state: OpenState
    _tree: RadixTree
    _device_pool: KVPool
    _host_pool: KVPool
    _component_pools: dict[str, ComponentPools]
    _release_queue: ReleaseQueue
    _copies: CopyTracker
    _mover: TierMover
    _prefetcher: Prefetcher
    _accounting: Accounting
    _workers: Workers
