"""A failed layer-wise load whose pages a holder below keeps on the device never hands out bytes that are
no node's KV.

The load's pages cannot leave the device tier while a device-only node below them is locked (a lease) or
being backed up: the tree poisons the failed nodes (no match reaches them or anything below), and the
loader copies their host values into their pages once more; when that lands they are hits again, with
the right KV. If that copy fails too, they stay unmatched until their holders let go and eviction takes
them. `sanity_check`, the locks and the device pool's accounting hold after each.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import anyio.lowlevel
import anyio.to_thread
import pytest
import torch

from hicache import HiCache, Lease, LoadBackFailed, Namespace
from hicache.keys import as_key_bytes
from storage_backends.memory import MemoryBackend
from tests.cache_internals import layered_loader_of, tree_of
from tests.controller.controller_helpers import PAGE, make_config, page_payload, store_sequence, tokens
from tests.controller.test_layerwise_failures import LAYERS, LAYOUT4, SEQ, Hold, assert_no_locks, settle

LONGER = [*SEQ, *tokens(500, PAGE)]


@pytest.fixture(params=["write_back", "write_through"])
async def cache(request: pytest.FixtureRequest) -> AsyncIterator[HiCache]:
    """A layer-wise cache (4 layers) whose storage holds `SEQ`; write-back (no backups) or
    write-through."""
    async with (
        MemoryBackend(namespace_digest=Namespace().digest) as backend,
        HiCache(
            make_config(layout=LAYOUT4, layerwise_load_back=True, write_policy=request.param),
            storage=backend,
        ) as c,
    ):
        await store_sequence(backend, c, SEQ, LAYOUT4)
        yield c


async def compute_and_insert(cache: HiCache, lease: Lease, seq: list[int]) -> None:
    """The request holding `lease` computed all of `seq` itself (it acquired before `seq`'s prefix was
    cached) and inserts it: the loaded prefix is a duplicate, the page beyond a device-only child."""
    new = await cache.alloc_device(len(seq) - lease.cached_len)
    assert new is not None
    cache.device_pool.write_tokens(new, page_payload(as_key_bytes(seq)[lease.cached_len * 8 :], LAYOUT4))
    await cache.insert(lease, seq, torch.cat([lease.device_indices, new]))


async def load_failing_under_a_child(cache: HiCache, again: Hold) -> tuple[Hold, Lease]:
    """`SEQ` loads back layer-wise (held before layer 1, to fail once released); meanwhile a request that
    computed `LONGER` itself inserts it (a device-only child below the loading pages). The copy again,
    after the failure, runs under the hook `again`. Returns the held load's hook and its lease."""
    early = await cache.acquire("early", tokens(9000, PAGE))  # nothing cached: it computes LONGER itself
    hold = Hold(1, fail=True)
    loader = layered_loader_of(cache)
    loader.before_layer = hold
    loading = await cache.acquire("loading", SEQ)
    assert loading.hit_tokens_by_tier["storage"] == 16
    await anyio.to_thread.run_sync(hold.reached.wait)
    loader.before_layer = again
    await compute_and_insert(cache, early, LONGER)
    return hold, loading


async def fail_the_load(hold: Hold, loading: Lease) -> None:
    """Let the held load fail, and wait until it finished failing (its readiness is revoked then, its
    pages dropped or poisoned, and the copy again started: it holds at its own hook)."""
    hold.release()
    while not loading.layers.done:
        await anyio.lowlevel.checkpoint()


def assert_unmatched(cache: HiCache) -> None:
    """No match reaches the failed pages or the child below them."""
    for key in (SEQ, LONGER):
        match = cache.match(key)
        assert (match.device_len, match.host_len) == (0, 0), key


def assert_longer_is_a_correct_device_hit(cache: HiCache) -> None:
    match = cache.match(LONGER)
    assert match.device_len == 20
    expected = page_payload(as_key_bytes(LONGER), LAYOUT4)
    assert torch.equal(cache.device_pool.read_tokens(match.device_indices), expected)


async def test_a_locked_child_below_keeps_the_failed_pages_unmatched_until_copied_again(
    cache: HiCache,
) -> None:
    """Guards against the kept path: a lease on the child below (a request that matched the loading
    pages and the child) kept the failed pages on the device, and the next acquire of the prefix was
    handed them as a device hit full of bytes that were no node's KV (a layer never landed)."""
    free_before = cache.statistics().device_pool.free_pages
    again = Hold(0, fail=False)
    hold, loading = await load_failing_under_a_child(cache, again)
    holder = await cache.acquire("holder", LONGER)
    assert (holder.cached_len, holder.hit_tokens_by_tier["device"]) == (20, 20)
    await fail_the_load(hold, loading)
    cache.sanity_check()
    assert_unmatched(cache)
    meanwhile = await cache.acquire("meanwhile", LONGER)  # recomputes: never handed the failed pages
    assert meanwhile.cached_len == 0
    cache.release(meanwhile)
    again.release()
    await settle(cache)
    for lease in (loading, holder):  # both read through the failed load: told, never handed its bytes
        with pytest.raises(LoadBackFailed):
            lease.layers.wait_layer(LAYERS - 1)
    cache.sanity_check()
    assert_longer_is_a_correct_device_hit(cache)  # copied again from the host: hits again, right KV
    again = await cache.acquire("again", LONGER)
    assert again.cached_len == 20
    for layer in range(LAYERS):
        again.layers.wait_layer(layer)
    expected = page_payload(as_key_bytes(LONGER), LAYOUT4)
    assert torch.equal(cache.device_pool.read_tokens(again.device_indices), expected)
    for lease in (loading, holder, again):
        cache.release(lease)
    await settle(cache)
    cache.sanity_check()
    assert_no_locks(cache)
    assert cache.statistics().device_pool.free_pages == free_before - 5  # the tree's 20 tokens


async def test_a_failed_copy_again_leaves_them_unmatched_until_evicted(cache: HiCache) -> None:
    """Guards against the kept path when copying again fails too: the failed pages stay on the device
    (the lease below still holds them) but no match reaches them; once the lease is released, eviction
    takes them like any page and frees each once; the host copy is then a correct hit."""
    free_before = cache.statistics().device_pool.free_pages
    again = Hold(0, fail=True)
    hold, loading = await load_failing_under_a_child(cache, again)
    holder = await cache.acquire("holder", LONGER)
    await fail_the_load(hold, loading)
    assert_unmatched(cache)
    again.release()
    await settle(cache)
    cache.sanity_check()
    # Write-back: still held below, unmatched. Write-through: the child's backup committed meanwhile, so
    # the second failure took the pages off the device after all; the host copies are hits.
    assert all(cache.match(key).device_len == 0 for key in (SEQ, LONGER))
    for lease in (loading, holder):
        cache.release(lease)
    await settle(cache)
    cache.sanity_check()
    assert_no_locks(cache)
    assert all(cache.match(key).device_len == 0 for key in (SEQ, LONGER))
    everything = await cache.alloc_device(free_before * PAGE)  # evicts the whole device tier
    assert everything is not None
    cache.device_pool.free(everything)
    cache.sanity_check()
    assert cache.statistics().device_pool.free_pages == free_before
    layered_loader_of(cache).before_layer = None
    fresh = await cache.acquire("fresh", SEQ)
    assert fresh.hit_tokens_by_tier["host"] == 16
    for layer in range(LAYERS):
        await fresh.layers.wait_layer_async(layer)
    assert torch.equal(
        cache.device_pool.read_tokens(fresh.device_indices), page_payload(as_key_bytes(SEQ), LAYOUT4)
    )
    await settle(cache)
    cache.release(fresh)
    cache.sanity_check()
    assert_no_locks(cache)


async def test_a_backup_in_flight_below_keeps_the_failed_pages_unmatched_until_copied_again() -> None:
    """Guards against the kept path through a backup: the child inserted below (write-through) is being
    backed up when the load fails, so the failed pages stay on the device; no match reaches them, the
    child's backup commits its own pages, and once copied again the prefix is a correct hit."""
    async with (
        MemoryBackend(namespace_digest=Namespace().digest) as backend,
        HiCache(
            make_config(layout=LAYOUT4, layerwise_load_back=True, write_policy="write_through"),
            storage=backend,
        ) as cache,
    ):
        await store_sequence(backend, cache, SEQ, LAYOUT4)
        free_before = cache.statistics().device_pool.free_pages
        # One copying thread: the child's backup waits behind the held load, so it is in flight when the
        # load fails.
        cache._copies.limiter = anyio.CapacityLimiter(1)
        again = Hold(0, fail=False)
        hold, loading = await load_failing_under_a_child(cache, again)
        tree = tree_of(cache)
        child = tree.match_prefix(LONGER).last_device_node
        assert tree.node_info(child).num_tokens == PAGE
        while tree.node_info(child).backup_pending is None:  # the worker begins it on a later turn
            await anyio.lowlevel.checkpoint()
        await fail_the_load(hold, loading)
        cache.sanity_check()
        assert_unmatched(cache)
        again.release()
        await settle(cache)
        cache.sanity_check()
        assert tree.node_info(child).host_value is not None  # the child's backup committed
        assert_longer_is_a_correct_device_hit(cache)
        cache.release(loading)
        await settle(cache)
        cache.sanity_check()
        assert_no_locks(cache)
        assert cache.statistics().device_pool.free_pages == free_before - 5
