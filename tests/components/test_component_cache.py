"""Hybrid components through the controller: the seed's drop, all-or-nothing staging, and a round trip
through backup, storage, prefetch and load-back."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import anyio
import pytest
import torch
from cache_internals import component_pools_of, host_pool_of, release_queue_of, tree_of
from component_helpers import (
    PAGE,
    WINDOW,
    base_payload,
    hybrid_config,
    serve_hybrid,
    state_payload,
    store_hybrid,
    swa_payload,
    tokens,
)

from hicache import DropReason, HiCache, PrefetchState
from hicache.components import component_storage_key
from hicache.keys import ROOT_HASH, Namespace, as_key_bytes, chained_page_hashes
from hicache.memory import Owner
from hicache.metrics import render
from storage_backends.memory import MemoryBackend
from tests.controller.controller_helpers import PassThroughBackend


@pytest.fixture
async def backend() -> AsyncIterator[MemoryBackend]:
    async with MemoryBackend(namespace_digest=Namespace().digest) as b:
        yield b


async def open_cache(backend: object, *names: str, **overrides: object) -> HiCache:
    cache = HiCache(hybrid_config(*names, **overrides), storage=backend)  # type: ignore[arg-type]
    await cache.start()
    return cache


def assert_every_pool_full(cache: HiCache) -> None:
    pools = [cache.device_pool, host_pool_of(cache)]
    for device_pool, host_pool in component_pools_of(cache).values():
        pools.extend((device_pool, host_pool))
    for pool in pools:
        assert pool.statistics().used_pages == 0, pool


async def test_seed_drop_releases_pages_and_both_component_transfers_in_one_call(
    backend: MemoryBackend,
) -> None:
    """The seed (SGLang #31902) with components: a 32-token refill carrying a 16-slot window transfer and a
    1-slot state transfer, attached below a device-only node under write-through, is dropped in exactly
    one release call (pages, then the transfers in order); nothing of it is committed."""
    cache = await open_cache(backend)
    try:
        seq = tokens(500, 32)
        await store_hybrid(backend, cache, seq)
        device = cache.device_pool.alloc(16, Owner.TREE)  # handed straight to the tree
        assert device is not None
        tree_of(cache).insert(seq[:16], device)  # full attention only, not backed up yet
        anchor = tree_of(cache).match_prefix(seq[:16])
        (parent,) = tree_of(cache).node_info(tree_of(cache).root).children
        assert tree_of(cache).node_info(parent).device_value is not None
        assert not tree_of(cache).node_info(parent).backed_up
        assert anchor.device_len == 0  # no window, no state: not a usable prefix
        release_queue_of(cache).history = []
        prefetch = await cache.prefetch("r1", seq)
        assert prefetch is not None
        assert prefetch.num_tokens == 32
        host_indices = prefetch.host_indices
        transfers = prefetch.transfers
        assert [(t.component, t.indices.numel()) for t in transfers] == [("swa", 16), ("mamba", 1)]
        outcome = await cache.commit_prefetch("r1")
        assert outcome.status == "dropped"
        assert prefetch.state is PrefetchState.DROPPED
        assert outcome.loaded_tokens == 0
        assert len(release_queue_of(cache).history) == 1
        release = release_queue_of(cache).history[0]
        assert torch.equal(release.host_indices, host_indices[:32])
        assert release.transfers == transfers
        assert [t.component for t in release.transfers] == ["swa", "mamba"]
        stats = tree_of(cache).component_statistics()
        assert all(s.host_slots == 0 and s.pending_backup_slots == 0 for s in stats.values())
        assert tree_of(cache).node_info(parent).children == ()
        cache.sanity_check()
        evicted = tree_of(cache).evict_device(16)
        cache.device_pool.free(evicted.freed_device, Owner.TREE)
        await release_queue_of(cache).drain()
        cache.sanity_check()
        assert_every_pool_full(cache)
    finally:
        await cache.aclose()


async def test_a_missing_state_in_storage_skips_the_prefetch_and_keeps_nothing(
    backend: MemoryBackend,
) -> None:
    """All or nothing: pages without their end state are useless to a Mamba model; nothing is allocated."""
    cache = await open_cache(backend)
    try:
        seq = tokens(1, 32)
        await store_hybrid(backend, cache, seq, with_state=False)
        assert await cache.prefetch("r1", seq) is None
        assert 'reason="component_miss"' in render(cache.registry)
        assert_every_pool_full(cache)
        cache.sanity_check()
    finally:
        await cache.aclose()


async def test_a_prefetch_that_stops_short_of_its_window_is_dropped_in_one_call(
    backend: MemoryBackend,
) -> None:
    """A refill that ends before its last page (a damaged page) has no window or state at its end: commit
    drops every page and both component transfers in one release call."""
    cache = await open_cache(backend)
    try:
        seq = tokens(1, 32)
        keys = await store_hybrid(backend, cache, seq)
        release_queue_of(cache).history = []
        prefetch = await cache.prefetch("r1", seq)
        assert prefetch is not None
        await backend.delete([keys[5]])  # streaming stops at page 5 (20 tokens)
        outcome = await cache.commit_prefetch("r1")
        assert (outcome.status, outcome.completed_tokens, outcome.loaded_tokens) == ("dropped", 20, 0)
        assert outcome.drop_reason is DropReason.COMPONENT_INCOMPLETE
        (release,) = release_queue_of(cache).history
        assert torch.equal(release.host_indices, prefetch.host_indices)
        assert release.transfers == prefetch.transfers
        assert tree_of(cache).statistics().num_nodes == 0
        await release_queue_of(cache).drain()
        cache.sanity_check()
        assert_every_pool_full(cache)
    finally:
        await cache.aclose()


async def test_backup_storage_prefetch_and_load_back_carry_every_component_bitwise(
    backend: MemoryBackend,
) -> None:
    """Instance A serves a request; its window and state are backed up and written through to storage
    under page-hash-plus-name keys. Instance B acquires the same tokens from storage: the lease's window
    KV and state on B's device are exactly A's."""
    seq = tokens(300, 32)
    key = as_key_bytes(seq)
    first = await open_cache(backend)
    try:
        await serve_hybrid(first, seq)
        await first.wait_idle()
        first.sanity_check()
        stats = first.statistics()  # components and their pools are observable without the internals
        assert stats.components == tree_of(first).component_statistics()
        assert (stats.components["swa"].host_slots, stats.components["mamba"].host_slots) == (WINDOW, 1)
        for name, pools in component_pools_of(first).items():
            assert stats.component_pools[name] == (pools.device.statistics(), pools.host.statistics())
        hashes = chained_page_hashes(key, PAGE, first.config.namespace, ROOT_HASH)
        comp_keys = [component_storage_key(h, "swa") for h in hashes[-WINDOW // PAGE :]]
        comp_keys.append(component_storage_key(hashes[-1], "mamba"))
        for k in comp_keys:
            assert await backend.exists([k]) == 1
    finally:
        await first.aclose()
    second = await open_cache(backend)
    try:
        lease = await second.acquire("again", seq)
        assert lease.cached_len == 32
        assert lease.hit_tokens_by_tier["storage"] == 32
        assert torch.equal(second.device_pool.read_tokens(lease.device_indices), base_payload(key))
        swa_pool = second.component_pool("swa")
        state_pool = second.component_pool("mamba")
        assert torch.equal(
            swa_pool.read_tokens(lease.component_indices["swa"]), swa_payload(key[-WINDOW * 8 :])
        )
        assert torch.equal(state_pool.read_tokens(lease.component_indices["mamba"]), state_payload(key))
        second.release(lease)
        await second.wait_idle()
        second.sanity_check()
    finally:
        await second.aclose()


async def test_full_attention_only_cache_has_no_component_pools(backend: MemoryBackend) -> None:
    """Backward compatibility: without components nothing changes, and component calls are refused."""
    from hicache import HiCacheConfig

    config = hybrid_config()
    plain = HiCacheConfig(layout=config.layout, device_pages=8, host_pages=8)
    cache = HiCache(plain, storage=backend)
    await cache.start()
    try:
        assert component_pools_of(cache) == {}
        with pytest.raises(ValueError, match="unknown component"):
            cache.alloc_component("swa", PAGE)
        lease = await cache.acquire("r", tokens(0, 8))
        assert lease.component_indices == {}
        cache.release(lease)
        cache.sanity_check()
    finally:
        await cache.aclose()


class HungComponentLookup(PassThroughBackend):
    """Storage whose `exists` for component pages never returns (a hung mount); base pages answer."""

    def __init__(self, inner: MemoryBackend) -> None:
        super().__init__(inner)
        self.hung = anyio.Event()
        self.never = anyio.Event()

    async def exists(self, keys: Sequence[str]) -> int:
        if keys and len(keys[0]) != 2 * len(ROOT_HASH):  # a component's key: longer than a page hash
            self.hung.set()
            await self.never.wait()
        return await self.inner.exists(keys)


async def test_a_component_lookup_timeout_is_a_storage_error_for_the_breaker(
    backend: MemoryBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 22 item 6: a component lookup cut off by `storage_read_timeout_s` was counted as
    `component_miss` (blaming storage contents for an outage) and never reached the breaker. Now it is a
    `timeout` failure, a storage error of op `exists`, and a breaker failure. The deadline fires when the
    test moves the loop's clock, never because real time passed."""
    loop = asyncio.get_running_loop()
    real_time, offset = loop.time, [0.0]
    monkeypatch.setattr(loop, "time", lambda: real_time() + offset[0])
    hung = HungComponentLookup(backend)
    cache = await open_cache(hung)
    try:
        seq = tokens(1, 32)
        await store_hybrid(backend, cache, seq)
        async with anyio.create_task_group() as tg:
            started: list[object] = []

            async def start() -> None:
                started.append(await cache.prefetch("r1", seq))

            tg.start_soon(start)
            await hung.hung.wait()
            offset[0] += cache.config.storage_read_timeout_s + 1
        assert started == [None]
        lines = render(cache.registry).splitlines()
        assert not [ln for ln in lines if 'reason="component_miss"' in ln]
        timeouts = [ln for ln in lines if "page_failures_total{" in ln and 'reason="timeout"' in ln]
        assert [ln.rsplit(" ", 1)[1] for ln in timeouts] == ["1.0"]
        errors = [ln for ln in lines if "storage_errors_total{" in ln and 'op="exists"' in ln]
        assert ['kind="timeout"' in ln and ln.endswith(" 1.0") for ln in errors] == [True]
        assert cache.storage_breaker.statistics().consecutive_failures == 1
        assert_every_pool_full(cache)
        cache.sanity_check()
    finally:
        await cache.aclose()
