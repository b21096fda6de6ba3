"""The one place tests reach into a `HiCache`'s private parts: its tree, host pool, component pools and
release queue. The public API hands none of them out; the oracles and scenarios need them to check page
ownership and content exactly and to stage situations (a page handed straight to the tree)."""

from __future__ import annotations

from collections.abc import Mapping

from hicache import HiCache, KVPool
from hicache.controller.movement.layered_load import LayeredLoader
from hicache.controller.pages.allocation import ComponentPools
from hicache.controller.pages.release import ReleaseQueue
from hicache.controller.storage.writer import StorageWriter
from hicache.tree import RadixTree


def tree_of(cache: HiCache) -> RadixTree:
    """The cache's radix tree."""
    return cache._tree


def host_pool_of(cache: HiCache) -> KVPool:
    """The cache's host pool."""
    return cache._host_pool


def component_pools_of(cache: HiCache) -> Mapping[str, ComponentPools]:
    """The cache's component pools (device and host), by component name."""
    return cache._component_pools


def release_queue_of(cache: HiCache) -> ReleaseQueue:
    """The cache's release queue."""
    return cache._release_queue


def layered_loader_of(cache: HiCache) -> LayeredLoader:
    """The cache's layer-wise load-back runner (tests hold a layer back with its `before_layer`)."""
    return cache._loader


def storage_writer_of(cache: HiCache) -> StorageWriter:
    """The cache's host -> storage writer (it must have a storage tier)."""
    writer = cache._mover.writer
    assert writer is not None, "the cache has no storage tier"
    return writer
