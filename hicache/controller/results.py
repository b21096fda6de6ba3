"""What the cache hands back: a request's `Lease` and the `CacheStatistics` snapshot."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from hicache.controller.pages.release import ReleaseStatistics
from hicache.controller.prefetch.job import PrefetchOutcome
from hicache.controller.storage.guarded import BreakerStatistics
from hicache.memory import PoolStatistics
from hicache.memory.layerwise import ALL_READY, LayerReadiness
from hicache.tiers import SkipReason
from hicache.tree import ComponentStatistics, NodeRef, TreeStatistics

__all__ = ["CacheStatistics", "ComponentPoolStatistics", "Lease"]


@dataclass
class Lease:
    """A request's hold on its cached prefix, from `acquire` until `insert` or `release`.

    The prefix's nodes are device-locked for the lease's lifetime, so its device pages stay valid.

    Attributes:
        request_id: the request.
        key: the request's tokens as int64 bytes.
        node: the deepest cached node (device-locked); the root when nothing was cached.
        device_indices: device pool indices of the cached prefix, one per token.
        cached_len: tokens of the prefix available on device.
        hit_tokens_by_tier: where the cached tokens came from, by `Tier` (`device`, `host`, `storage`).
            A storage hit is a token this request's own prefetch loaded; tokens another request put in
            the tree meanwhile count by the tier this request found them on.
        prefetch: the outcome of the request's storage prefetch, if one ran.
        prefetch_skipped: why no storage prefetch ran, when the cache has a storage tier and skipped it
            (None when one ran, or without a storage tier).
        component_indices: per hybrid component, the device indices the prefix uses (the sliding
            window's KV, the Mamba state's slot); empty without components.
        layers: which layers of the prefix have landed on the device: call `layers.wait_layer(i)` before
            reading layer i of `device_indices` (a layer-wise load-back may still be copying it). Ready at
            once unless `layerwise_load_back` is on or another request's layer-wise load is in flight.
    """

    request_id: str
    key: bytes
    node: NodeRef
    device_indices: torch.Tensor
    cached_len: int
    hit_tokens_by_tier: dict[str, int]
    prefetch: PrefetchOutcome | None = None
    active: bool = field(default=True, repr=False)
    component_indices: dict[str, torch.Tensor] = field(default_factory=dict)
    prefetch_skipped: SkipReason | None = None
    layers: LayerReadiness = field(default=ALL_READY, repr=False)


class ComponentPoolStatistics(NamedTuple):
    """A hybrid component's two pools, as statistics."""

    device: PoolStatistics
    host: PoolStatistics


@dataclass(frozen=True)
class CacheStatistics:
    """A snapshot of the whole cache."""

    tree: TreeStatistics
    device_pool: PoolStatistics
    host_pool: PoolStatistics
    release_queue: ReleaseStatistics
    prefetches_in_flight: int
    prefetch_tokens_in_flight: int
    backups_queued: int
    storage_writes_queued: int
    closed: bool
    quarantined_pages: int = 0
    """Host pages held out of use because a stray storage thread may still write into them (released
    through the release queue once it returns)."""
    detached_prefetches: int = 0
    """Cancelled prefetches whose stream is still stopping; their pages go back when it has."""
    backups_queued_max: int = 0
    """The most backups ever queued at once (never above `config.backup_queue_limit`)."""
    storage_writes_queued_max: int = 0
    """The most storage writes ever queued at once (never above `config.storage_write_queue_limit`)."""
    storage_breaker: BreakerStatistics | None = None
    """The storage tier's circuit breaker (None without a storage tier)."""
    component_pools: dict[str, ComponentPoolStatistics] = field(default_factory=dict)
    """Per hybrid component, its device and host pools."""
    components: dict[str, ComponentStatistics] = field(default_factory=dict)
    """Per hybrid component, its slots in the tree by tier, in backups in flight and queued for freeing."""
