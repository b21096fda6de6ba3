"""A storage refill committed, or a computed key inserted, below poisoned nodes (a failed layer-wise load a
holder below kept on the device) is never served while they are poisoned, and is once their copy again
landed.

A request for a longer prefix than the failed one peeks nothing (the poisoned nodes end every match), so
its prefetch fetches the whole prefix from storage and commits it: the failed load's span is present
already (the poisoned nodes keep their host copy), the rest hangs below them as a host-only node. Its
lease must not be handed the failed pages; once the copy again landed the refill is a host hit below
them, loaded back with the right KV. `sanity_check` and the locks hold after each step.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import torch

from hicache import HiCache, Namespace
from hicache.keys import as_key_bytes
from storage_backends.memory import MemoryBackend
from tests.cache_internals import layered_loader_of, tree_of
from tests.controller.controller_helpers import PAGE, make_config, page_payload, store_sequence, tokens
from tests.controller.test_layerwise_failures import LAYERS, LAYOUT4, SEQ, Hold, assert_no_locks, settle
from tests.controller.test_layerwise_kept import compute_and_insert, fail_the_load, load_failing_under_a_child

REFILLED = [*SEQ, *tokens(700, PAGE)]
"""Through the failed load's span to a page only storage holds (beside the child the holder computed)."""


@pytest.fixture(params=["write_back", "write_through"])
async def cache(request: pytest.FixtureRequest) -> AsyncIterator[HiCache]:
    """A layer-wise cache (4 layers) whose storage holds `REFILLED` (and so `SEQ`)."""
    async with (
        MemoryBackend(namespace_digest=Namespace().digest) as backend,
        HiCache(
            make_config(layout=LAYOUT4, layerwise_load_back=True, write_policy=request.param),
            storage=backend,
        ) as c,
    ):
        await store_sequence(backend, c, REFILLED, LAYOUT4)
        yield c


async def test_a_refill_below_poisoned_nodes_is_served_only_once_their_copy_again_landed(
    cache: HiCache,
) -> None:
    """Guards against a prefetch commit reopening the failed pages: the refill's lease gets no cached
    prefix while the copy again is held, and the refill is a correct hit once it landed."""
    again = Hold(0, fail=False)
    hold, loading = await load_failing_under_a_child(cache, again)
    holder = await cache.acquire("holder", [*SEQ, *tokens(500, PAGE)])  # keeps the failed pages below
    try:
        await fail_the_load(hold, loading)
        cache.sanity_check()
        refill = await cache.acquire("refill", REFILLED)
        assert refill.prefetch is not None
        assert refill.prefetch.committed
        assert refill.cached_len == 0  # recomputes: never handed the failed pages
        assert refill.device_indices.numel() == 0
        cache.release(refill)
        cache.sanity_check()
        match = cache.match(REFILLED)
        assert (match.device_len, match.host_len) == (0, 0)
        peek = tree_of(cache).peek(REFILLED)
        assert (peek.device_len, peek.host_len, peek.anchor_len) == (0, 0, 0)
    finally:  # a failed check must not leave the copy again held (the fixture waits for it)
        again.release()
    await settle(cache)
    cache.sanity_check()
    match = cache.match(REFILLED)
    assert (match.device_len, match.host_len) == (16, PAGE)  # the refill, below the recopied pages
    layered_loader_of(cache).before_layer = None
    served = await cache.acquire("served", REFILLED)
    assert served.cached_len == 20
    for layer in range(LAYERS):
        await served.layers.wait_layer_async(layer)
    expected = page_payload(as_key_bytes(REFILLED), LAYOUT4)
    assert torch.equal(cache.device_pool.read_tokens(served.device_indices), expected)
    await settle(cache)
    for lease in (loading, holder, served):
        cache.release(lease)
    await settle(cache)
    cache.sanity_check()
    assert_no_locks(cache)


async def test_a_key_computed_below_poisoned_nodes_is_served_once_their_copy_again_landed(
    cache: HiCache,
) -> None:
    """Guards against an insert reopening the failed pages: a request that computed a key through the
    poisoned nodes inserts it while their copy again is held; the poisoned span counts as cached (its own
    copy is freed), the rest hangs below unserved; once the copy again landed the key is a device hit
    with the right KV throughout (the recopied pages and the request's own)."""
    sibling = [*SEQ, *tokens(800, PAGE)]
    free_before = cache.statistics().device_pool.free_pages
    again = Hold(0, fail=False)
    hold, loading = await load_failing_under_a_child(cache, again)
    holder = await cache.acquire("holder", [*SEQ, *tokens(500, PAGE)])
    try:
        await fail_the_load(hold, loading)
        computing = await cache.acquire("computing", sibling)
        assert computing.cached_len == 0
        await compute_and_insert(cache, computing, sibling)
        cache.sanity_check()
        match = cache.match(sibling)
        assert (match.device_len, match.host_len) == (0, 0)
        assert cache.statistics().device_pool.free_pages == free_before - 6  # 16 + 4 + 4 tokens
    finally:
        again.release()
    await settle(cache)
    cache.sanity_check()
    match = cache.match(sibling)
    assert match.device_len == 20
    expected = page_payload(as_key_bytes(sibling), LAYOUT4)
    assert torch.equal(cache.device_pool.read_tokens(match.device_indices), expected)
    for lease in (loading, holder):
        cache.release(lease)
    await settle(cache)
    cache.sanity_check()
    assert_no_locks(cache)
