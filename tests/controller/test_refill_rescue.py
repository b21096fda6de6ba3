"""Refill rescue (`refill_under_unbacked="backup_then_attach"`): a storage refill below a fresh device
prefix that is not backed up yet is attached after backing that prefix up, instead of being dropped; when
the backup cannot happen (no host room, a failed copy) or the commit is cancelled meanwhile, everything is
released exactly as a drop or a cancel does, once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import torch

from hicache import HiCache, Namespace, UnknownRequest
from hicache.controller.movement import copies as copies_module
from hicache.keys import as_key_bytes
from hicache.tiers import DropReason
from storage_backends.cancellation import uncancellable
from storage_backends.memory import MemoryBackend
from tests.cache_internals import host_pool_of, tree_of
from tests.controller.controller_helpers import (
    insert_device_chain,
    make_config,
    page_payload,
    store_sequence,
    tokens,
)

SEQ = tokens(1, 32)
FRESH = SEQ[:16]


@pytest.fixture
async def backend() -> AsyncIterator[MemoryBackend]:
    async with MemoryBackend(namespace_digest=Namespace().digest) as b:
        yield b


def cache_with(backend: MemoryBackend, policy: str, **overrides: object) -> HiCache:
    """Write-through (selective with a threshold never reached: the fresh prefix stays un-backed until
    something backs it up) over `backend`."""
    options: dict[str, object] = {
        "write_policy": "write_through_selective",
        "write_through_threshold": 100,
        "refill_under_unbacked": policy,
    }
    options.update(overrides)
    return HiCache(make_config(**options), storage=backend)


async def fresh_prefix_below_a_storage_hit(cache: HiCache, backend: MemoryBackend) -> None:
    """The first 16 tokens computed on the device (not backed up); all 32 stored by another instance."""
    await insert_device_chain(cache, FRESH)
    await store_sequence(backend, cache, SEQ)
    match = cache.match(SEQ)
    assert (match.device_len, match.host_len) == (16, 0)


async def released_everything(cache: HiCache) -> None:
    await cache.wait_idle()
    cache.sanity_check()
    assert cache.statistics().prefetches_in_flight == 0


async def test_drop_policy_drops_the_refill(backend: MemoryBackend) -> None:
    """The default: the refill would hang below an un-backed node, so it is dropped and released."""
    async with cache_with(backend, "drop") as cache:
        await fresh_prefix_below_a_storage_hit(cache, backend)
        assert await cache.prefetch("r", SEQ) is not None
        outcome = await cache.commit_prefetch("r")
        assert outcome.status == "dropped"
        assert outcome.drop_reason is DropReason.ANCHOR_NOT_BACKED_UP
        assert not outcome.rescued
        assert cache.match(SEQ).host_len == 0
        await released_everything(cache)
        assert host_pool_of(cache).statistics().used_pages == 0


async def test_backup_then_attach_rescues_the_refill(backend: MemoryBackend) -> None:
    """The fresh prefix is backed up (root first) and the refill attached below it: 16 more tokens hit,
    with exactly the stored bytes, and every page has one owner."""
    async with cache_with(backend, "backup_then_attach") as cache:
        await fresh_prefix_below_a_storage_hit(cache, backend)
        assert tree_of(cache).refill_backup_plan(tree_of(cache).root, as_key_bytes(SEQ))
        assert await cache.prefetch("r", SEQ) is not None
        outcome = await cache.commit_prefetch("r")
        assert outcome.status == "committed"
        assert outcome.rescued
        assert outcome.loaded_tokens == 16
        match = cache.match(SEQ)
        assert (match.device_len, match.host_len) == (16, 16)
        assert match.last_host_node is match.host_nodes[-1]
        assert not tree_of(cache).refill_backup_plan(tree_of(cache).root, as_key_bytes(SEQ))
        lease = await cache.acquire("reader", SEQ)
        assert lease.cached_len == 32
        got = cache.device_pool.read_tokens(lease.device_indices)
        assert torch.equal(got, page_payload(as_key_bytes(SEQ)))
        cache.release(lease)
        await released_everything(cache)


async def test_no_host_room_drops_as_today(backend: MemoryBackend) -> None:
    """The refill's own pages fill the host pool: the backup finds no room, the refill is dropped and
    every page goes back."""
    async with cache_with(backend, "backup_then_attach", host_pages=8, prefetch_capacity_tokens=32) as cache:
        await fresh_prefix_below_a_storage_hit(cache, backend)
        assert await cache.prefetch("r", SEQ) is not None
        outcome = await cache.commit_prefetch("r")
        assert outcome.status == "dropped"
        assert outcome.drop_reason is DropReason.ANCHOR_NOT_BACKED_UP
        assert not outcome.rescued
        await released_everything(cache)
        assert host_pool_of(cache).statistics().used_pages == 0
        assert cache.match(SEQ).host_len == 0


async def test_a_failed_backup_copy_drops_as_today(
    backend: MemoryBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The device -> host copy fails: the backup is undone, the refill dropped, every page released."""
    async with cache_with(backend, "backup_then_attach") as cache:
        await fresh_prefix_below_a_storage_hit(cache, backend)
        assert await cache.prefetch("r", SEQ) is not None

        async def failing_copy(*args: object, **kwargs: object) -> None:
            raise OSError("simulated copy failure")

        monkeypatch.setattr(copies_module, "copy_pages_async", failing_copy)
        outcome = await cache.commit_prefetch("r")
        assert outcome.status == "dropped"
        assert not outcome.rescued
        monkeypatch.undo()
        await released_everything(cache)
        assert host_pool_of(cache).statistics().used_pages == 0
        assert cache.match(SEQ).host_len == 0


@pytest.mark.parametrize("how", ["asyncio.timeout", "task.cancel"])
async def test_cancelled_mid_backup_releases_everything_once(
    backend: MemoryBackend, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """The commit is cancelled while the rescue's backup copy is held. The ranks' decision was already
    taken out of the agreement, so the commit is carried out whole (the copy lands, the backup is kept,
    the refill attached) and only then does the cancellation propagate: the prefetch is resolved, every
    page has one owner, and nothing is left to release a second time. (A commit that stopped half-way
    here used to leave the prefetch in flight with its decision consumed: under TP the other ranks had
    committed it.)"""
    real_copy = copies_module.copy_pages_async
    copy_started = asyncio.Event()
    finish_copy = asyncio.Event()

    async def held_copy(*args: object, **kwargs: object) -> None:
        async def copy() -> None:
            copy_started.set()
            await finish_copy.wait()
            await real_copy(*args, **kwargs)  # type: ignore[arg-type]

        await uncancellable(copy())  # like a real copy: never abandoned

    async with cache_with(backend, "backup_then_attach") as cache:
        await fresh_prefix_below_a_storage_hit(cache, backend)
        assert await cache.prefetch("r", SEQ) is not None
        monkeypatch.setattr(copies_module, "copy_pages_async", held_copy)
        deadline = asyncio.timeout(None)

        async def commit() -> None:
            async with deadline:
                await cache.commit_prefetch("r")

        loop = asyncio.get_running_loop()
        task = loop.create_task(commit())
        await copy_started.wait()
        if how == "asyncio.timeout":
            deadline.reschedule(loop.time())
        else:
            task.cancel()
        finish_copy.set()
        (done,) = await asyncio.gather(task, return_exceptions=True)
        monkeypatch.undo()
        assert isinstance(done, TimeoutError if how == "asyncio.timeout" else asyncio.CancelledError)
        await released_everything(cache)  # resolved: committed, sanity_check holds
        with pytest.raises(UnknownRequest):
            await cache.cancel_prefetch("r")  # nothing left to release twice
        match = cache.match(SEQ)
        assert (match.device_len, match.host_len) == (16, 16)  # backed up, and the refill attached
        assert not tree_of(cache).refill_backup_plan(tree_of(cache).root, as_key_bytes(SEQ))
        page = cache.config.page_size
        assert host_pool_of(cache).statistics().used_pages == 32 // page  # the backup's and the refill's
        lease = await cache.acquire("reader", SEQ)
        assert lease.cached_len == 32
        assert torch.equal(
            cache.device_pool.read_tokens(lease.device_indices), page_payload(as_key_bytes(SEQ))
        )
        cache.release(lease)
        await released_everything(cache)
