"""Regression tests for the lifecycle traps of issue 10 (finding 5), one scenario each.

* `wait_idle()` never returned after or during `aclose()` when a backup was queued;
* `aclose()` inside `anyio.move_on_after` raised RuntimeError and left the task cancelled; inside
  `asyncio.wait_for` it raised CancelledError;
* a failed `start()` left both pools allocated;
* `acquire()` during `aclose()` could raise `UnknownRequest` instead of `CacheClosed`.
"""

from __future__ import annotations

import asyncio
import gc
import warnings
from collections.abc import AsyncIterator

import anyio
import anyio.lowlevel
import pytest
from cache_internals import host_pool_of
from controller_helpers import GatedBackend, make_config, page_payload, store_sequence, tokens

from hicache import HiCache
from hicache.errors import CacheClosed
from hicache.keys import Namespace, as_key_bytes
from storage_backends.memory import MemoryBackend


@pytest.fixture
async def backend() -> AsyncIterator[MemoryBackend]:
    async with MemoryBackend(namespace_digest=Namespace().digest) as b:
        yield b


async def insert_with_backup_queued(cache: HiCache, seq: list[int]) -> None:
    """Insert `seq` under write-through: its backup is queued and has not run yet (no await since)."""
    lease = await cache.acquire(f"fill-{seq[0]}", seq)
    new = await cache.alloc_device(len(seq))
    assert new is not None
    cache.device_pool.write_tokens(new, page_payload(as_key_bytes(seq)))
    await cache.insert(lease, seq, new)
    assert cache.statistics().backups_queued == 1


async def test_wait_idle_returns_when_aclose_drops_a_queued_backup() -> None:
    """A task waiting in wait_idle while the cache closes with a backup queued returns, and so does a
    wait_idle called afterwards (both waited forever: the dropped backup never finished)."""
    cache = HiCache(make_config(write_policy="write_through"))
    await cache.start()
    returned: list[str] = []

    async def waiter() -> None:
        await cache.wait_idle()
        returned.append("during")

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await insert_with_backup_queued(cache, tokens(1, 16))
            tg.start_soon(waiter)
            await anyio.wait_all_tasks_blocked()
            await cache.aclose()
        await cache.wait_idle()
        returned.append("after")
    assert returned == ["during", "after"]
    assert cache.statistics().backups_queued == 0


async def test_aclose_inside_move_on_after_neither_raises_nor_leaves_the_task_cancelled() -> None:
    """aclose from a newer cancel scope than start's: it returns normally and the task goes on (it raised
    RuntimeError, exiting the workers' task group from the wrong scope, and the task stayed cancelled)."""
    cache = HiCache(make_config())
    await cache.start()
    await insert_with_backup_queued(cache, tokens(1, 16))
    with anyio.move_on_after(10) as scope:
        await cache.aclose()
    assert not scope.cancelled_caught
    await anyio.lowlevel.checkpoint()  # a cancelled task would raise here
    assert host_pool_of(cache).closed
    assert cache.device_pool.closed


async def test_aclose_whose_deadline_passes_inside_move_on_after_leaves_the_task_usable(
    backend: MemoryBackend,
) -> None:
    """Even when the caller's deadline is what ends aclose's wait, the deadline is absorbed by its scope
    and the cache still finishes closing in the background."""
    cache = HiCache(make_config(), storage=backend)
    await cache.start()
    with anyio.move_on_after(0):
        await cache.aclose()
    await anyio.lowlevel.checkpoint()
    with anyio.fail_after(10):
        await cache.aclose()
    assert host_pool_of(cache).closed


async def test_aclose_inside_asyncio_wait_for_returns_normally() -> None:
    """`asyncio.wait_for(cache.aclose(), 10)` returns None (it raised CancelledError)."""
    cache = HiCache(make_config())
    await cache.start()
    await insert_with_backup_queued(cache, tokens(1, 16))
    assert await asyncio.wait_for(cache.aclose(), 10) is None
    await asyncio.sleep(0)
    assert host_pool_of(cache).closed


async def test_a_failed_start_closes_both_pools() -> None:
    """start() failing to open the storage backend (a bad option) closes the pools and the cache; nothing
    is left to warn about (both pools stayed allocated)."""
    cache = HiCache(make_config(storage_url="memory://", storage_options={"no_such_option": 1}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(TypeError, match="no_such_option"):
            async with cache:
                pass
        assert cache.device_pool.closed
        assert host_pool_of(cache).closed
        assert cache.statistics().closed
        with pytest.raises(CacheClosed):
            await cache.start()
        del cache
        gc.collect()
    assert [w for w in caught if issubclass(w.category, ResourceWarning)] == []


async def test_acquire_during_aclose_raises_cache_closed(backend: MemoryBackend) -> None:
    """An acquire waiting for its prefetch when the cache closes raises CacheClosed (it raised
    UnknownRequest: aclose had resolved the prefetch under it), naming `acquire`, not the inner step that
    noticed (issue 22 item 14: it named `request_id:`)."""
    gated = GatedBackend(backend)
    cache = HiCache(make_config(prefetch_stop_policy="wait_complete"), storage=gated)  # type: ignore[arg-type]
    await cache.start()
    seq = tokens(1, 16)
    await store_sequence(backend, cache, seq)
    errors: list[BaseException] = []

    async def request() -> None:
        try:
            await cache.acquire("r", seq)
        except CacheClosed as exc:
            errors.append(exc)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(request)
            await anyio.wait_all_tasks_blocked()
            assert cache.statistics().prefetches_in_flight == 1
            await cache.aclose()
    assert len(errors) == 1
    assert [str(e).split(":")[0] for e in errors] == ["acquire"]
    assert host_pool_of(cache).closed
    assert cache.statistics().prefetches_in_flight == 0
