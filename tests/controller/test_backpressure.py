"""Backpressure on background writes: bounded backup and storage-write queues that shed the newest work
(counted in `writes_shed_total`), and a storage writer that keeps up with a saturated event loop."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import anyio
import pytest
import torch
from cache_internals import tree_of
from controller_helpers import LAYOUT, PAGE, PassThroughBackend, insert_device_chain, make_config, tokens

from hicache import HiCache
from hicache.controller.movement.work_queue import WorkQueue
from hicache.tree import NodeInfo
from storage_backends.file import FileBackend
from storage_backends.memory import MemoryBackend


def shed(cache: HiCache, tier: str, reason: str) -> float:
    return cache.metrics.writes_shed.value(tier=tier, reason=reason)


async def test_a_full_work_queue_refuses_the_newest_items_in_order() -> None:
    """`put` keeps what fits, in order, and returns the rest; the worker gets them in batches."""
    seen: list[list[int]] = []

    async def job(batch: list[int]) -> None:
        seen.append(batch)

    queue: WorkQueue[int] = WorkQueue("numbers", job, limit=3, max_batch=2)
    assert queue.put([1, 2]) == []
    assert queue.put([3, 4, 5]) == [4, 5]
    assert len(queue) == 3
    assert queue.max_queued == 3
    async with anyio.create_task_group() as tg:
        tg.start_soon(queue.run)
        await queue.wait_idle()
        tg.cancel_scope.cancel()
    assert seen == [[1, 2], [3]]
    assert queue.idle
    with pytest.raises(ValueError, match="limit"):
        WorkQueue("bad", job, limit=0)


async def test_wait_below_returns_once_the_worker_took_the_items() -> None:
    """The producer's backpressure wait ends when the worker takes a batch, not when it finishes it."""
    gate = anyio.Event()

    async def job(batch: list[int]) -> None:
        await gate.wait()

    queue: WorkQueue[int] = WorkQueue("held", job, limit=8, max_batch=4)
    queue.put(list(range(6)))
    async with anyio.create_task_group() as tg:
        tg.start_soon(queue.run)
        await queue.wait_below(2)
        assert len(queue) == 2
        assert not queue.idle
        gate.set()
        await queue.wait_idle()
        tg.cancel_scope.cancel()


class GatedPuts(PassThroughBackend):
    """A memory backend whose `put` waits for `gate`; `puts` counts the calls that started."""

    def __init__(self, inner: MemoryBackend) -> None:
        super().__init__(inner)
        self.gate = anyio.Event()
        self.puts = 0

    async def put(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[bool]:
        self.puts += 1
        await self.gate.wait()
        return await self.inner.put(keys, buffers)


async def test_storage_writes_beyond_the_limit_are_shed_newest_first_and_counted() -> None:
    """Storage stalls (a put held at a gate) while requests keep evicting under write-back: the storage
    writes stop at their limit (the one being written counts), later writes are shed and counted, and once storage moves again the
    oldest work is what reached it (the first prompt's pages are there, the shed ones are not)."""
    inner = MemoryBackend(namespace_digest=make_config().namespace.digest)
    storage = GatedPuts(inner)
    limit = 2
    config = make_config(
        device_pages=8, write_policy="write_back", storage_write_queue_limit=limit, prefetch_threshold=PAGE
    )
    prompts = [tokens(1000 * (i + 1), 4 * PAGE) for i in range(8)]
    async with inner:
        async with HiCache(config, storage=storage) as cache:
            for prompt in prompts:  # each alloc evicts (backs up, then queues the write of) an older prompt
                await insert_device_chain(cache, prompt)
                await anyio.wait_all_tasks_blocked()
            stats = cache.statistics()
            assert storage.puts == 1, "the writer is held in its first put"
            assert stats.storage_writes_queued + 1 == limit, "one write held in its put, the rest queued"
            assert stats.storage_writes_queued_max <= limit
            evicted = len(prompts) - 2
            assert shed(cache, "storage", "queue_full") == evicted - limit
            storage.gate.set()
            await cache.wait_idle()
            cache.sanity_check()

        async with HiCache(make_config(prefetch_threshold=PAGE), storage=inner) as reader:
            first = await reader.acquire("first", prompts[0])
            assert first.hit_tokens_by_tier["storage"] == 4 * PAGE
            reader.release(first)
            newest_evicted = await reader.acquire("newest", prompts[evicted - 1])
            assert newest_evicted.hit_tokens_by_tier["storage"] == 0
            reader.release(newest_evicted)
            assert reader.metrics.prefetch_skipped.value(reason="storage_miss") == 1


@pytest.mark.parametrize("backend", ["file", "memory"])
async def test_saturated_soak_keeps_queues_bounded_and_storage_writes_flowing(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Eight workers serve requests back to back, never pausing (the loop is never idle): both queues
    stay within their limits, pages reach storage during the soak, and a later cache hits them.

    Guards against write-through that only progressed when the loop was idle: on a saturated loop the
    backup queue grew without bound and almost nothing reached storage. On the memory backend a request
    never suspends at all, so the workers run only because `insert` gives them their turn.
    """
    url = f"file://{tmp_path}" if backend == "file" else f"memory://soak-{id(request)}"
    backup_limit, storage_limit = 8, 4
    config = make_config(
        device_pages=256,
        host_pages=1024,
        storage_url=url,
        backup_queue_limit=backup_limit,
        storage_write_queue_limit=storage_limit,
        prefetch_threshold=4 * PAGE,
    )
    rng = random.Random(7)
    systems = [tokens(10**6 * (s + 1), 8 * PAGE) for s in range(4)]
    requests = 240
    async with HiCache(config) as cache:
        cursor = iter(range(requests))

        async def worker() -> None:
            for i in cursor:
                suffix = tokens(10**8 + 1000 * i, PAGE * rng.randrange(1, 6))
                lease = await cache.acquire(f"soak-{i}", systems[i % 4] + suffix)
                n = len(systems[i % 4]) + len(suffix)
                new = await cache.alloc_device(n - lease.cached_len)
                if new is None:
                    cache.release(lease)
                    continue
                payload = torch.zeros(LAYOUT.num_layers, 2, n - lease.cached_len, 1, LAYOUT.head_dim)
                cache.device_pool.write_tokens(new, payload)
                await cache.insert(lease, systems[i % 4] + suffix, torch.cat([lease.device_indices, new]))

        async with anyio.create_task_group() as tg:
            for _ in range(8):
                tg.start_soon(worker)
        storage = cache.storage
        assert isinstance(storage, FileBackend | MemoryBackend)
        written_during_soak = storage.statistics().pages_written
        stats = cache.statistics()
        assert stats.backups_queued_max <= backup_limit
        assert stats.storage_writes_queued_max <= storage_limit
        assert written_during_soak > 0, "storage writes made progress while the loop was saturated"
        await cache.wait_idle()
        cache.sanity_check()

    async with HiCache(make_config(storage_url=url, prefetch_threshold=4 * PAGE)) as reader:
        hits = 0
        for s, system in enumerate(systems):
            lease = await reader.acquire(f"later-{s}", system)
            hits += lease.hit_tokens_by_tier["storage"]
            reader.release(lease)
        assert hits > 0, "a later prefetch hit what the soak wrote"


async def test_a_queued_write_holds_its_host_pages_until_it_is_written() -> None:
    """Storage stalls while a small host pool turns over (issue 22 item 3): every write accepted into the
    queue reaches storage once storage moves again. Host eviction cannot take a queued write's pages (they
    are host-locked from queueing until written); what finds no host room is never backed up, so never
    queued. Before, host eviction took queued nodes and their writes were lost (shed as `evicted`)."""
    inner = MemoryBackend(namespace_digest=make_config().namespace.digest)
    storage = GatedPuts(inner)
    config = make_config(device_pages=8, host_pages=8, write_policy="write_back", prefetch_threshold=PAGE)
    prompts = [tokens(1000 * (i + 1), 4 * PAGE) for i in range(5)]
    async with inner, HiCache(config, storage=storage) as cache:
        for prompt in prompts:
            await insert_device_chain(cache, prompt)
            await anyio.wait_all_tasks_blocked()
        assert storage.puts == 1, "the writer is held in its first put"
        queued_or_running = cache.statistics().storage_writes_queued + 1
        storage.gate.set()
        await cache.wait_idle()
        cache.sanity_check()
        assert shed(cache, "storage", "queue_full") == 0
        backed_up_pages = int(cache.metrics.backup_tokens.value()) // PAGE
        assert inner.statistics().pages_written == backed_up_pages, "every backed-up page reached storage"
        assert inner.statistics().pages_written == 4 * queued_or_running
        assert all(info.host_lock == 0 for info in _nodes(cache)), "every write let go of its host lock"


def _nodes(cache: HiCache) -> list[NodeInfo]:
    tree = tree_of(cache)
    return [tree.node_info(node) for node in tree.iter_nodes()]


async def test_writes_still_queued_at_close_let_go_of_their_host_locks() -> None:
    """Closing the cache while storage stalls: the write running is cancelled and the queued ones are
    dropped, and each lets go of the host lock it took when it was queued (none is left behind)."""
    inner = MemoryBackend(namespace_digest=make_config().namespace.digest)
    storage = GatedPuts(inner)
    config = make_config(device_pages=8, host_pages=32, write_policy="write_back", prefetch_threshold=PAGE)
    async with inner:
        async with HiCache(config, storage=storage) as cache:
            for i in range(5):
                await insert_device_chain(cache, tokens(1000 * (i + 1), 4 * PAGE))
                await anyio.wait_all_tasks_blocked()
            assert storage.puts == 1
            assert cache.statistics().storage_writes_queued >= 1
            assert any(info.host_lock for info in _nodes(cache))
        assert all(info.host_lock == 0 for info in _nodes(cache))
        tree_of(cache).sanity_check()
