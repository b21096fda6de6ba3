"""Eviction liveness with hybrid components (issue 10, finding 4): the write-back plan drops or backs up
nodes that carry sliding-window KV and Mamba states, and every component pool stays exactly accounted."""

from __future__ import annotations

import pytest
import torch
from component_helpers import WINDOW, base_payload, hybrid_config, state_payload, swa_payload, tokens

from hicache import HiCache
from hicache.keys import as_key_bytes
from hicache.policy import WritePolicy


async def serve_hybrid(cache: HiCache, seq: list[int]) -> None:
    """Serve `seq` as a hybrid model would: full-attention KV, the window's KV and the end state."""
    lease = await cache.acquire(f"fill-{seq[-1]}", seq)
    n = len(seq)
    key = as_key_bytes(seq)
    new = await cache.alloc_device(n - lease.cached_len)
    assert new is not None
    cache.device_pool.write_tokens(new, base_payload(key[lease.cached_len * 8 :]))
    swa = cache.alloc_component("swa", WINDOW)
    state = cache.alloc_component("mamba", 1)
    assert swa is not None
    assert state is not None
    cache.component_pools["swa"][0].write_tokens(swa, swa_payload(key[(n - WINDOW) * 8 :]))
    cache.component_pools["mamba"][0].write_tokens(state, state_payload(key))
    await cache.insert(lease, seq, torch.cat([lease.device_indices, new]), {"swa": swa, "mamba": state})


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
        assert free + cache.tree.statistics().evictable_device_tokens == 48

        got = await cache.alloc_device(48)

        assert got is not None
        cache.sanity_check(held_device_tokens=48)
        assert cache.tree.statistics().device_tokens == 0
        for name, stats in cache.tree.component_statistics().items():
            assert stats.device_slots == 0, name  # the device values went with their nodes
        cache.device_pool.free(got)
        await cache.wait_idle()
        cache.sanity_check()
