"""A layer-wise load-back that fails or is cancelled never hands a model KV that is not its own.

A copy failure (injected in the copying thread at the first, a middle or the last layer) or a cancellation
of the load's task at any of its awaits (before its first step, while the thread copies, twice over, after
the thread finished) ends the same way: readers of a layer the copy never landed get `LoadBackFailed`
naming the layer, the pages leave the device tier (no later request matches them; a fresh acquire loads
the host copy again, correctly), they are freed once, and the load's locks are released exactly once. A
copy that did land before the cancellation keeps its pages. `sanity_check` and the device pool's free
count hold after each.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable

import anyio
import anyio.lowlevel
import anyio.to_thread
import pytest
import torch

from hicache import HiCache, KVLayout, Lease, LoadBackFailed, Namespace
from hicache.keys import as_key_bytes
from storage_backends.memory import MemoryBackend
from tests.cache_internals import layered_loader_of, tree_of
from tests.controller.controller_helpers import PAGE, make_config, page_payload, store_sequence, tokens

LAYERS = 4
LAYOUT4 = KVLayout(num_layers=LAYERS, num_kv_heads=1, head_dim=4, dtype=torch.float32, page_size=PAGE)
SEQ = tokens(1, 16)


@pytest.fixture
async def cache() -> AsyncIterator[HiCache]:
    """A layer-wise cache whose storage holds `SEQ` (4 layers, so there is a middle one)."""
    async with (
        MemoryBackend(namespace_digest=Namespace().digest) as backend,
        HiCache(make_config(layout=LAYOUT4, layerwise_load_back=True), storage=backend) as c,
    ):
        await store_sequence(backend, c, SEQ, LAYOUT4)
        yield c


class Hold:
    """A `before_layer` hook: holds the copy before `layer` until `release()`, then fails it if `fail`."""

    def __init__(self, layer: int, *, fail: bool) -> None:
        self.layer = layer
        self.fail = fail
        self.reached = threading.Event()
        self._go = threading.Event()

    def __call__(self, layer: int) -> None:
        if layer == self.layer:
            self.reached.set()
            self._go.wait()
            if self.fail:
                raise RuntimeError(f"injected copy failure at layer {layer}")

    def release(self) -> None:
        self._go.set()


def fail_at(layer: int) -> Callable[[int], None]:
    """A `before_layer` hook that fails the copy at `layer` at once."""
    hold = Hold(layer, fail=True)
    hold.release()
    return hold


async def settle(cache: HiCache) -> None:
    """Wait until every layer-wise load has finished (its task and done callback included)."""
    await cache.wait_idle()
    loader = layered_loader_of(cache)
    while loader.in_flight or loader._tasks:
        await anyio.lowlevel.checkpoint()


def load_task(cache: HiCache) -> asyncio.Task[None]:
    """The one layer-wise load's task."""
    (task,) = layered_loader_of(cache)._tasks
    return task


def assert_no_locks(cache: HiCache) -> None:
    """No node holds a lock: the load's (and every lease's) were released exactly once (twice would have
    raised or gone negative, which `sanity_check` reports)."""
    tree = tree_of(cache)
    for node in tree.iter_nodes():
        info = tree.node_info(node)
        assert (info.device_lock, info.host_lock) == (0, 0), info


async def assert_dropped_and_recomputable(cache: HiCache, lease: object, free_before: int) -> None:
    """The failed load touched nothing in the tree and its pages were freed once; the lease can only be
    released; a fresh acquire loads the host copy again, bit for bit."""
    assert isinstance(lease, Lease)
    for layer in range(LAYERS):
        with pytest.raises(LoadBackFailed, match=f"layer {layer}"):
            lease.layers.wait_layer(layer)  # revoked: raises at once, never blocks
    match = cache.match(SEQ)
    assert (match.device_len, match.host_len) == (0, 16)
    cache.sanity_check()
    assert cache.statistics().device_pool.free_pages == free_before
    with pytest.raises(LoadBackFailed, match="lease"):
        await cache.insert(lease, SEQ, lease.device_indices)
    cache.release(lease)
    cache.sanity_check()
    assert_no_locks(cache)
    layered_loader_of(cache).before_layer = None
    again = await cache.acquire("recompute", SEQ)
    assert again.hit_tokens_by_tier["host"] == 16
    for layer in range(LAYERS):
        await again.layers.wait_layer_async(layer)
    expected = page_payload(as_key_bytes(SEQ), LAYOUT4)
    assert torch.equal(cache.device_pool.read_tokens(again.device_indices), expected)
    await settle(cache)
    cache.release(again)
    cache.sanity_check()
    assert_no_locks(cache)


@pytest.mark.parametrize("failed_layer", [0, 1, LAYERS - 1], ids=["first", "middle", "last"])
async def test_a_failed_copy_drops_its_pages_and_every_reader_is_told(
    cache: HiCache, failed_layer: int
) -> None:
    """Guards against a failed copy only being logged: its pages stayed device hits full of bytes that
    are no node's KV, and the model read them."""
    free_before = cache.statistics().device_pool.free_pages
    layered_loader_of(cache).before_layer = fail_at(failed_layer)
    lease = await cache.acquire("r1", SEQ)
    assert lease.cached_len == 16
    await settle(cache)
    await assert_dropped_and_recomputable(cache, lease, free_before)


async def test_a_reader_waiting_on_the_failing_layer_is_woken_with_its_name(cache: HiCache) -> None:
    """Layers that landed before the failure are readable while they are the tree's; a reader blocked on
    the failing layer (this request's, or a second request's that matched the loading pages) raises
    `LoadBackFailed` naming that layer instead of waiting forever or reading garbage."""
    free_before = cache.statistics().device_pool.free_pages
    hold = Hold(2, fail=True)
    layered_loader_of(cache).before_layer = hold
    first = await cache.acquire("r1", SEQ)
    await anyio.to_thread.run_sync(hold.reached.wait)
    await anyio.to_thread.run_sync(first.layers.wait_layer, 1)  # landed before the failure
    second = await cache.acquire("r2", SEQ)  # shares the landing load: its pages, its outcome
    assert second.hit_tokens_by_tier["host"] == 16
    assert torch.equal(second.device_indices, first.device_indices)
    errors: list[BaseException] = []

    async def wait_layer_2() -> None:
        try:
            await anyio.to_thread.run_sync(second.layers.wait_layer, 2)
        except LoadBackFailed as exc:
            errors.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait_layer_2)
        await anyio.wait_all_tasks_blocked()
        hold.release()
    assert len(errors) == 1
    assert "layer 2" in str(errors[0])
    await settle(cache)
    cache.release(second)
    await assert_dropped_and_recomputable(cache, first, free_before)


@pytest.mark.parametrize("cancels", [1, 2], ids=["once", "twice"])
async def test_cancelled_while_copying_drops_and_unlocks_once(cache: HiCache, cancels: int) -> None:
    """The loop cancels the load's task while its thread copies (once, or again while the load waits
    for the thread): the thread stops at its next layer, nothing is freed before it stopped, and the
    pages are dropped and the locks released exactly once."""
    free_before = cache.statistics().device_pool.free_pages
    hold = Hold(1, fail=False)
    layered_loader_of(cache).before_layer = hold
    lease = await cache.acquire("r1", SEQ)
    await anyio.to_thread.run_sync(hold.reached.wait)
    task = load_task(cache)
    task.cancel()
    await anyio.wait_all_tasks_blocked()
    for _ in range(cancels - 1):
        task.cancel()
        await anyio.wait_all_tasks_blocked()
    assert layered_loader_of(cache).in_flight == 1  # still waiting for the thread: nothing freed yet
    hold.release()
    await settle(cache)
    assert task.cancelled()
    await assert_dropped_and_recomputable(cache, lease, free_before)


async def test_cancelled_before_its_first_step_drops_and_unlocks_once(cache: HiCache) -> None:
    """A task cancelled before it ever ran (a loop shutting down right after `acquire`) never enters
    `_run`: its done callback drops the uncopied pages and releases the locks."""
    free_before = cache.statistics().device_pool.free_pages
    lease = await cache.acquire("r1", SEQ)
    task = load_task(cache)
    task.cancel()
    await settle(cache)
    assert task.cancelled()
    await assert_dropped_and_recomputable(cache, lease, free_before)


async def test_cancelled_after_the_copy_landed_keeps_the_pages(cache: HiCache) -> None:
    """A cancellation that reaches the task once its thread has copied every layer: the pages hold the
    KV, so they stay device hits; only the locks are released, once."""
    hold = Hold(LAYERS - 1, fail=False)
    layered_loader_of(cache).before_layer = hold
    lease = await cache.acquire("r1", SEQ)
    await anyio.to_thread.run_sync(hold.reached.wait)
    task = load_task(cache)
    (load,) = layered_loader_of(cache)._landing.values()
    hold.release()
    # Block the loop until the thread returned: the task has not resumed yet, so the cancellation reaches
    # it at the await the copy's result would have woken.
    load.copy._thread_done.wait()
    assert task.cancel()
    await settle(cache)
    assert task.cancelled()
    for layer in range(LAYERS):
        lease.layers.wait_layer(layer)  # ready: returns at once
    expected = page_payload(as_key_bytes(SEQ), LAYOUT4)
    assert torch.equal(cache.device_pool.read_tokens(lease.device_indices), expected)
    cache.release(lease)
    cache.sanity_check()
    assert_no_locks(cache)
    assert cache.match(SEQ).device_len == 16


async def test_a_longer_request_over_a_landing_load_waits_for_it_then_loads_its_own(cache: HiCache) -> None:
    """Guards against a longer request reading through a landing load it does not wholly share: before,
    it matched through the first load's pages, loaded the rest of its prefix below them, and when the
    first load failed the pages below were dropped under its running copy. Now its host hit overlaps a
    landing load it cannot share, so it waits for that load to end; once it failed, the longer request
    loads its whole prefix itself, with the right KV, and nothing was freed under a running copy."""
    free_before = cache.statistics().device_pool.free_pages
    loader = layered_loader_of(cache)
    upper = Hold(1, fail=True)
    loader.before_layer = upper
    first = await cache.acquire("r1", SEQ[:8])
    assert first.cached_len == 8
    got: list[Lease] = []
    try:
        await anyio.to_thread.run_sync(upper.reached.wait)
        async with anyio.create_task_group() as tg:

            async def acquire_longer() -> None:
                got.append(await cache.acquire("r2", SEQ))

            tg.start_soon(acquire_longer)
            await anyio.wait_all_tasks_blocked()
            assert not got  # waits for the first load to end
            assert loader.in_flight == 1  # and copies nothing meanwhile
            cache.sanity_check()
            loader.before_layer = None
            upper.release()
    finally:  # a failed check must not leave a copying thread held (the fixture waits for it)
        upper.release()
    (second,) = got
    assert (second.cached_len, second.hit_tokens_by_tier["device"]) == (16, 0)
    expected = page_payload(as_key_bytes(SEQ), LAYOUT4)
    for layer in range(LAYERS):
        await second.layers.wait_layer_async(layer)
    assert torch.equal(cache.device_pool.read_tokens(second.device_indices), expected)
    with pytest.raises(LoadBackFailed):
        first.layers.wait_layer(LAYERS - 1)
    await settle(cache)
    for lease in (first, second):
        cache.release(lease)
    cache.sanity_check()
    assert_no_locks(cache)
    assert cache.statistics().device_pool.free_pages == free_before - 4  # the tree's 16 tokens
    assert cache.match(SEQ).device_len == 16


async def test_a_lease_on_a_failed_load_is_refused_even_once_the_prefix_loaded_again(cache: HiCache) -> None:
    """Guards against `insert` only checking that the lease's node is off the device: once another request
    loaded the same prefix back (into other pages), a lease whose own load failed inserted KV its model
    computed over the failed pages as this prefix's continuation."""
    layered_loader_of(cache).before_layer = fail_at(1)
    failed = await cache.acquire("r1", SEQ)
    await settle(cache)
    layered_loader_of(cache).before_layer = None
    again = await cache.acquire("r2", SEQ)
    assert again.hit_tokens_by_tier["host"] == 16
    await settle(cache)
    longer = [*SEQ, *tokens(500, PAGE)]
    new = await cache.alloc_device(PAGE)
    assert new is not None
    with pytest.raises(LoadBackFailed, match="lease"):
        await cache.insert(failed, longer, torch.cat([failed.device_indices, new]))
    cache.release(failed, new)
    cache.release(again)
    cache.sanity_check()
    assert_no_locks(cache)
    assert cache.match(longer).device_len == 16
