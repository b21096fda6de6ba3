"""Eviction liveness with hybrid components (issue 10, finding 4): the write-back plan drops or backs up
nodes that carry sliding-window KV and Mamba states, and every component pool stays exactly accounted."""

from __future__ import annotations

import pytest
from cache_internals import tree_of
from component_helpers import hybrid_config, serve_hybrid, tokens

from hicache import HiCache
from hicache.policy import WritePolicy


@pytest.mark.parametrize("policy", list(WritePolicy), ids=lambda p: p.value)
@pytest.mark.parametrize("host_pages", [1, 4])
async def test_shared_prefix_with_components_does_not_stall_a_small_host(
    policy: WritePolicy, host_pages: int
) -> None:
    """The reported repro on a hybrid model: a 16-token parent with two 8-token children, each request
    ending in a window and a state; a host of one page or of 16 tokens. The whole device can be had, and
    every base and component page is in exactly one place afterwards."""
    config = hybrid_config(device_pages=12, host_pages=host_pages, write_policy=policy)
    async with HiCache(config) as cache:
        await serve_hybrid(cache, tokens(0, 16) + tokens(100, 8))
        await serve_hybrid(cache, tokens(0, 16) + tokens(200, 8))
        await cache.wait_idle()
        cache.sanity_check()
        free = cache.device_pool.statistics().free_pages * cache.page_size
        assert free + tree_of(cache).statistics().evictable_device_tokens == 48

        got = await cache.alloc_device(48)

        assert got is not None
        cache.sanity_check(held_device_tokens=48)
        assert tree_of(cache).statistics().device_tokens == 0
        for name, stats in tree_of(cache).component_statistics().items():
            assert stats.device_slots == 0, name  # the device values went with their nodes
        cache.device_pool.free(got)
        await cache.wait_idle()
        cache.sanity_check()
