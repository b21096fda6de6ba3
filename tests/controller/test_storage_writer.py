"""The host -> storage writer's own bookkeeping, one call at a time and several at once."""

from __future__ import annotations

from collections.abc import Sequence

import anyio
from cache_internals import release_queue_of, storage_writer_of, tree_of
from controller_helpers import (
    PAGE,
    PassThroughBackend,
    insert_device_chain,
    make_config,
    page_payload,
    store_sequence,
    tokens,
)

from hicache import HiCache
from hicache.keys import ROOT_HASH, as_key_bytes, chained_page_hashes
from storage_backends.memory import MemoryBackend
from storage_backends.protocol import PageStatus
from storage_backends.threads import stray_threads


class StrayFirstPut(PassThroughBackend):
    """A memory backend whose first `put` leaves its buffers to a "stray thread" (registered with
    `stray_threads`, as a put that timed out leaves them) and waits at `release_first` before returning."""

    def __init__(self, inner: MemoryBackend) -> None:
        super().__init__(inner)
        self.first_started = anyio.Event()
        self.release_first = anyio.Event()
        self.stray: list[memoryview] = []

    async def put(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[bool]:
        if not self.first_started.is_set():
            self.stray = list(buffers)
            stray_threads.start(self.stray)
            self.first_started.set()
            await self.release_first.wait()
        return await self.inner.put(keys, buffers)


class CountingPuts(PassThroughBackend):
    """A memory backend that records every key `put` is given, call by call."""

    def __init__(self, inner: MemoryBackend) -> None:
        super().__init__(inner)
        self.puts: list[list[str]] = []

    async def put(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[bool]:
        self.puts.append(list(keys))
        return await self.inner.put(keys, buffers)


def page_keys(cache: HiCache, seq: Sequence[int]) -> list[str]:
    """The storage keys of the whole pages of `seq`, root first."""
    return [
        h.hex() for h in chained_page_hashes(as_key_bytes(list(seq)), PAGE, cache.config.namespace, ROOT_HASH)
    ]


async def test_one_job_puts_each_unknown_page_once_with_its_own_bytes() -> None:
    """One `store_many` over paths that share pages, some already in storage: one `put` call, each
    page absent from storage exactly once, every page's bytes its own. The job takes every path's page
    views from one `page_views` call and picks the pages to put by position; a position off by one
    would put a neighbour's bytes under a key, which only a content check sees."""
    inner = MemoryBackend(namespace_digest=make_config().namespace.digest)
    storage = CountingPuts(inner)
    config = make_config(backup_to_storage=False, prefetch_threshold=10**6)
    short = tokens(1000, 3 * PAGE)
    longer = short + tokens(5000, 2 * PAGE)  # shares the first three pages with `short`
    other = tokens(9000, 2 * PAGE)
    async with inner, HiCache(config, storage=storage) as cache:
        for seq in (short, longer, other):
            await insert_device_chain(cache, seq)
        await cache.wait_idle()
        await store_sequence(inner, cache, short[: 2 * PAGE])  # another instance wrote the first two
        tree, writer = tree_of(cache), storage_writer_of(cache)
        targets = [tree.match_prefix(as_key_bytes(seq)).last_host_node for seq in (other, longer, short)]
        for target in targets:
            tree.lock_host(target)
        done: list[bool] = []
        await writer.store_many(targets, on_done=lambda: done.append(True))
        assert done == [True]
        for target in targets:
            tree.unlock_host(target)
        # `exists` finds none of `other`'s pages first, so every path's unknown pages go in one put.
        expected = page_keys(cache, other) + page_keys(cache, longer)
        assert storage.puts == [expected]
        for seq in (short, longer, other):
            keys = page_keys(cache, seq)
            buffers = [memoryview(bytearray(cache.config.layout.page_nbytes)) for _ in keys]
            assert await inner.get(keys, buffers) == [PageStatus.HIT] * len(keys)
            key = as_key_bytes(seq)
            for i, buffer in enumerate(buffers):
                want = page_payload(key[i * PAGE * 8 : (i + 1) * PAGE * 8])
                assert bytes(buffer) == want.numpy().tobytes(), f"page {i} of a path holds other bytes"
        cache.sanity_check()


async def test_two_write_jobs_at_once_keep_their_own_buffers() -> None:
    """Two `store_many` jobs overlap (issue 22 item 7): the first job's put leaves a stray thread reading
    its pages while the second job runs. The first job keeps its pages locked until that thread returns;
    the second lets go of its own at once. Before, the buffers a call handed to `put` were instance state:
    the second call reset them, so the first let go of pages a stray `put` still read."""
    inner = MemoryBackend(namespace_digest=make_config().namespace.digest)
    storage = StrayFirstPut(inner)
    config = make_config(backup_to_storage=False, prefetch_threshold=PAGE)
    first, second = tokens(1000, 4 * PAGE), tokens(9000, 4 * PAGE)
    async with inner, HiCache(config, storage=storage) as cache:
        await insert_device_chain(cache, first)
        await insert_device_chain(cache, second)
        await cache.wait_idle()
        tree, writer = tree_of(cache), storage_writer_of(cache)
        targets = [tree.match_prefix(as_key_bytes(seq)).last_host_node for seq in (first, second)]
        for target in targets:
            tree.lock_host(target)
        let_go: list[str] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: writer.store_many(targets[:1], on_done=lambda: let_go.append("first")))
            await storage.first_started.wait()
            await writer.store_many(targets[1:], on_done=lambda: let_go.append("second"))
            assert let_go == ["second"]
            storage.release_first.set()
        assert let_go == ["second"], "a stray thread still reads the first job's pages: they stay locked"
        stray_threads.finish(storage.stray)
        release_queue_of(cache).flush()
        assert let_go == ["second", "first"]
        for target in targets:
            tree.unlock_host(target)
        cache.sanity_check()
