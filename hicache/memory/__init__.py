"""Page allocators, page-first KV pools on the device and in (pinned) host memory, and page copies."""

from __future__ import annotations

from hicache.layout import KVLayout
from hicache.memory.allocator import Owner, PageAllocator, check_token_indices
from hicache.memory.pool import HostPool, KVPool, PoolStatistics, make_device_pool, make_host_pool
from hicache.memory.transfer import copy_pages, copy_pages_async

__all__ = [
    "HostPool",
    "KVLayout",
    "KVPool",
    "Owner",
    "PageAllocator",
    "PoolStatistics",
    "check_token_indices",
    "copy_pages",
    "copy_pages_async",
    "make_device_pool",
    "make_host_pool",
]
