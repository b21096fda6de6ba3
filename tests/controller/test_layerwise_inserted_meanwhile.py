"""A prefix that another request computed and inserted while its layer-wise load-back was landing.

The landing pages are the load's own, so the insert takes the host-only nodes onto the device with the
inserter's pages (and a device-only child below), and a third request that acquires the longer key is
handed those. Whether the load then fails or lands, nothing anyone reads is bytes that are no node's KV:
a failed load touches nothing in the tree (before, its pages were in the tree, kept there by the locked
child below, poisoned and copied again); a load that lands finds its nodes on the device already, and
keeps the pages the tree did not take for its readers until the last one lets go. `sanity_check`, the
locks and the device pool's accounting hold after each.
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
from tests.cache_internals import layered_loader_of
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
    cached) and inserts it."""
    new = await cache.alloc_device(len(seq) - lease.cached_len)
    assert new is not None
    cache.device_pool.write_tokens(new, page_payload(as_key_bytes(seq)[lease.cached_len * 8 :], LAYOUT4))
    await cache.insert(lease, seq, torch.cat([lease.device_indices, new]))


async def insert_longer_while_seq_lands(cache: HiCache, fail: bool) -> tuple[Hold, Lease, Lease]:
    """`SEQ` loads back layer-wise, held before layer 1 (to fail once released, with `fail`); meanwhile
    a request that computed `LONGER` itself inserts it and another acquires `LONGER`. Returns the hold,
    the loading lease and the holder's."""
    early = await cache.acquire("early", tokens(9000, PAGE))  # nothing cached: it computes LONGER itself
    hold = Hold(1, fail=fail)
    loader = layered_loader_of(cache)
    loader.before_layer = hold
    loading = await cache.acquire("loading", SEQ)
    assert loading.hit_tokens_by_tier["storage"] == 16
    await anyio.to_thread.run_sync(hold.reached.wait)
    loader.before_layer = None
    await compute_and_insert(cache, early, LONGER)
    holder = await cache.acquire("holder", LONGER)
    assert (holder.cached_len, holder.hit_tokens_by_tier["device"]) == (20, 20)
    assert not bool(torch.isin(holder.device_indices, loading.device_indices).any())
    cache.sanity_check()
    return hold, loading, holder


def assert_reads_longer(cache: HiCache, lease: Lease) -> None:
    """`lease` holds `LONGER`'s KV on the device, every layer ready."""
    for layer in range(LAYERS):
        lease.layers.wait_layer(layer)
    expected = page_payload(as_key_bytes(LONGER), LAYOUT4)
    assert torch.equal(cache.device_pool.read_tokens(lease.device_indices), expected)


async def test_a_load_failing_under_a_prefix_inserted_meanwhile_touches_nothing(cache: HiCache) -> None:
    """Guards against the kept path: a failed load's pages were in the tree under a locked child below,
    and the next acquire of the prefix was handed them as a device hit full of bytes that were no node's
    KV. Now the insert's own pages hold the prefix, the failure only tells the load's reader, and every
    later acquire is a correct device hit."""
    free_before = cache.statistics().device_pool.free_pages
    hold, loading, holder = await insert_longer_while_seq_lands(cache, fail=True)
    hold.release()
    await settle(cache)
    for layer in range(LAYERS):
        with pytest.raises(LoadBackFailed):
            loading.layers.wait_layer(layer)
    with pytest.raises(LoadBackFailed, match="lease"):
        await cache.insert(loading, SEQ, loading.device_indices)
    assert_reads_longer(cache, holder)
    again = await cache.acquire("again", LONGER)
    assert again.hit_tokens_by_tier["device"] == 20
    assert_reads_longer(cache, again)
    for lease in (loading, holder, again):
        cache.release(lease)
    await settle(cache)
    cache.sanity_check()
    assert_no_locks(cache)
    assert cache.statistics().device_pool.free_pages == free_before - 5  # the tree's 20 tokens


async def test_a_load_landing_under_a_prefix_inserted_meanwhile_keeps_its_pages_for_its_reader(
    cache: HiCache,
) -> None:
    """Guards against a landed load freeing the pages its reader reads: the tree did not take them (its
    nodes are on the device with the insert's pages), so the load keeps them until its last reader lets
    go; the reader reads its own bytes, its insert succeeds, and then they are freed once."""
    free_before = cache.statistics().device_pool.free_pages
    hold, loading, holder = await insert_longer_while_seq_lands(cache, fail=False)
    hold.release()
    await settle(cache)
    for layer in range(LAYERS):
        loading.layers.wait_layer(layer)
    expected = page_payload(as_key_bytes(SEQ), LAYOUT4)
    assert torch.equal(cache.device_pool.read_tokens(loading.device_indices), expected)
    cache.sanity_check()  # the pages the tree did not take are the load's (a copy's) still
    assert cache.statistics().device_pool.free_pages == free_before - 5 - 4
    assert_reads_longer(cache, holder)
    await cache.insert(loading, SEQ, loading.device_indices)
    cache.release(holder)
    cache.sanity_check()
    assert_no_locks(cache)
    assert cache.statistics().device_pool.free_pages == free_before - 5
    match = cache.match(LONGER)
    assert match.device_len == 20
    assert torch.equal(
        cache.device_pool.read_tokens(match.device_indices), page_payload(as_key_bytes(LONGER), LAYOUT4)
    )
