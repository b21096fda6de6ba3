"""A layer-wise load whose task ended while its copy still ran never hands out the pages the copy writes.

`_run` waits for its copy on every way out (cancellations, once or twice over, are absorbed); what is left
is a task ended by something else while it waited (an exception other than a cancellation). The load then
cannot give its pages back yet: its thread may still write into them. It fails at once (its readers are
told), and its pages, which the tree never knew, stay the copy's (nothing matches, evicts or reuses them)
until the copy settled; then they are freed once. `sanity_check`, the locks and the pool's accounting
hold.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import anyio.lowlevel
import anyio.to_thread
import pytest
import torch

from hicache import HiCache, LoadBackFailed, Namespace
from hicache.keys import as_key_bytes
from hicache.memory import Owner
from storage_backends.memory import MemoryBackend
from tests.cache_internals import layered_loader_of, tree_of
from tests.controller.controller_helpers import PAGE, make_config, page_payload, store_sequence
from tests.controller.test_layerwise_failures import (
    LAYERS,
    LAYOUT4,
    SEQ,
    Hold,
    assert_no_locks,
    load_task,
    settle,
)


@pytest.fixture
async def cache() -> AsyncIterator[HiCache]:
    """A layer-wise cache (4 layers) whose storage holds `SEQ`."""
    async with (
        MemoryBackend(namespace_digest=Namespace().digest) as backend,
        HiCache(make_config(layout=LAYOUT4, layerwise_load_back=True), storage=backend) as c,
    ):
        await store_sequence(backend, c, SEQ, LAYOUT4)
        yield c


class Interrupted(BaseException):
    """Ends a load's task while it waits for its copy (neither an `Exception` nor a cancellation)."""


async def end_the_task_with_its_copy_running(cache: HiCache, monkeypatch: pytest.MonkeyPatch) -> Hold:
    """`SEQ` loads back layer-wise and is held before layer 1; its task is cancelled and, while it waits
    for the copy, ended by `Interrupted`. Returns the hold (the copy's thread still waits there)."""
    hold = Hold(1, fail=False)
    loader = layered_loader_of(cache)
    loader.before_layer = hold
    lease = await cache.acquire("r1", SEQ)
    assert lease.hit_tokens_by_tier["storage"] == 16
    await anyio.to_thread.run_sync(hold.reached.wait)
    (load,) = loader._landing.values()
    real_wait = load.copy.wait_settled
    waits: list[int] = []

    async def interrupted_wait() -> None:
        waits.append(1)
        if len(waits) == 1:
            raise Interrupted
        await real_wait()

    monkeypatch.setattr(load.copy, "wait_settled", interrupted_wait)
    task = load_task(cache)
    task.cancel()
    while lease.layers.is_ready(0):  # layer 0 landed: ready until the done callback revoked it
        await anyio.lowlevel.checkpoint()
    assert task.done()
    assert isinstance(task.exception(), Interrupted)
    assert not load.copy.settled  # the thread is still held before layer 1
    cache.release(lease)
    return hold


async def test_a_load_ended_with_its_copy_running_is_never_served(
    cache: HiCache,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Guards against the 'abandoned with its copy running' branch: it logged and left the pages attached,
    unpoisoned and, once the load's locks went, evictable, while the thread still wrote into them; the
    next acquire of the prefix was a device hit on layers that never landed, and eviction could hand the
    pages to another request under the running copy."""
    free_before = cache.statistics().device_pool.free_pages
    hold = await end_the_task_with_its_copy_running(cache, monkeypatch)
    try:
        cache.sanity_check()
        assert tree_of(cache).device_tokens_owned().numel() == 0  # the tree never knew the pages
        match = cache.match(SEQ)
        assert (match.device_len, match.host_len) == (0, 16)
        owners = cache.device_pool.owner_tags()
        writing = (owners == int(Owner.COPY)).nonzero().flatten()
        assert writing.numel() == 4  # the copy's 16 tokens, still its own
        layered_loader_of(cache).before_layer = None
        meanwhile = await cache.acquire("meanwhile", SEQ)  # loads the host copy again, elsewhere
        assert meanwhile.hit_tokens_by_tier["host"] == 16
        assert not bool(torch.isin(cache.device_pool.page_ids(meanwhile.device_indices), writing).any())
        for layer in range(LAYERS):
            await meanwhile.layers.wait_layer_async(layer)
        expected = page_payload(as_key_bytes(SEQ), LAYOUT4)
        assert torch.equal(cache.device_pool.read_tokens(meanwhile.device_indices), expected)
        await cache.wait_idle()
        cache.release(meanwhile)
        wanted = (cache.statistics().device_pool.free_pages + 4) * PAGE
        taken = await cache.alloc_device(wanted)  # would take the copy's pages if it could
        assert taken is None or not bool(torch.isin(cache.device_pool.page_ids(taken), writing).any())
        if taken is not None:
            cache.device_pool.free(taken)
        cache.sanity_check()
    finally:  # a failed check must not leave the copying thread held (the fixture waits for it)
        hold.release()
    await settle(cache)
    cache.sanity_check()
    assert_no_locks(cache)
    free_after = cache.statistics().device_pool.free_pages
    on_device = cache.match(SEQ).device_len // PAGE
    assert free_after + on_device == free_before  # the failed load's pages freed once
    layered_loader_of(cache).before_layer = None
    fresh = await cache.acquire("fresh", SEQ)
    assert fresh.cached_len == 16
    for layer in range(LAYERS):
        await fresh.layers.wait_layer_async(layer)
    assert torch.equal(cache.device_pool.read_tokens(fresh.device_indices), expected)
    await settle(cache)
    cache.release(fresh)
    cache.sanity_check()
    assert_no_locks(cache)


async def test_a_reader_of_a_load_ended_with_its_copy_running_is_told(
    cache: HiCache,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request that matched the loading pages before the task ended gets `LoadBackFailed` from every
    layer the copy had not landed, and its lease can only be released."""
    loader = layered_loader_of(cache)
    hold = Hold(1, fail=False)
    loader.before_layer = hold
    first = await cache.acquire("r1", SEQ)
    try:
        await anyio.to_thread.run_sync(hold.reached.wait)
        second = await cache.acquire("r2", SEQ)  # shares the landing load
        assert second.hit_tokens_by_tier["host"] == 16
        (load,) = loader._landing.values()

        async def interrupted_wait() -> None:
            raise Interrupted

        monkeypatch.setattr(load.copy, "wait_settled", interrupted_wait)
        load_task(cache).cancel()
        while second.layers.is_ready(0):  # layer 0 landed: ready until the done callback revoked it
            await anyio.lowlevel.checkpoint()
        for layer in range(LAYERS):
            with pytest.raises(LoadBackFailed):
                second.layers.wait_layer(layer)
        with pytest.raises(LoadBackFailed, match="lease"):
            await cache.insert(second, SEQ, second.device_indices)
        monkeypatch.undo()  # the deferred finish waits for the copy for real
    finally:
        hold.release()
    await settle(cache)
    for lease in (first, second):
        cache.release(lease)
    cache.sanity_check()
    assert_no_locks(cache)
    assert cache.match(SEQ).device_len == 0  # the failed load touched nothing in the tree


async def test_the_wait_for_the_copy_cancelled_before_it_ran_is_replaced(
    cache: HiCache,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Guards against a failed load's pages never going back: the task that waits for its copy is
    cancelled before its first step (a loop shutting down cancels every task it has); it never ran, so
    the pages stayed the copy's (and `aclose` waited for it forever). Its done callback now starts
    another wait, and the pages are freed once the copy settled."""
    free_before = cache.statistics().device_pool.free_pages
    loader = layered_loader_of(cache)
    real_give_back = loader._give_back
    cancelled: list[bool] = []

    def give_back_then_cancel_its_wait(load: object, pages: torch.Tensor) -> None:
        before = set(loader._tasks)
        real_give_back(load, pages)  # type: ignore[arg-type]
        started = set(loader._tasks) - before
        if started and not cancelled:
            (wait,) = started
            cancelled.append(wait.cancel())

    monkeypatch.setattr(loader, "_give_back", give_back_then_cancel_its_wait)
    hold = await end_the_task_with_its_copy_running(cache, monkeypatch)
    try:
        assert cancelled == [True]
        assert cache.match(SEQ).device_len == 0
    finally:
        hold.release()
    with anyio.fail_after(60):  # before the fix: never (the load stayed in flight)
        await settle(cache)
    cache.sanity_check()
    assert_no_locks(cache)
    assert cache.statistics().device_pool.free_pages == free_before
    match = cache.match(SEQ)
    assert (match.device_len, match.host_len) == (0, 16)
