"""Prefetch from storage: commit attaches, commit drops, stop policies, cancellation, faults."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence

import anyio
import pytest
import torch
from cache_internals import host_pool_of, release_queue_of, tree_of
from controller_helpers import (
    HOUR_S,
    PAGE,
    GatedBackend,
    LoopClock,
    PassThroughBackend,
    insert_device_chain,
    make_config,
    page_payload,
    store_sequence,
    tokens,
)

from hicache import DropReason, HiCache, PrefetchOutcome, PrefetchState, PrefetchStatus, UnknownRequest
from hicache.controller.pages.release import ComponentTransfer
from hicache.keys import ROOT_HASH, as_key_bytes, chained_page_hashes
from hicache.memory import Owner
from hicache.metrics import render
from storage_backends.memory import MemoryBackend
from storage_backends.protocol import PageStatus


@pytest.fixture
async def backend() -> AsyncIterator[MemoryBackend]:
    from hicache.keys import Namespace

    async with MemoryBackend(namespace_digest=Namespace().digest) as b:
        yield b


async def open_cache(backend: object, **overrides: object) -> HiCache:
    cache = HiCache(make_config(**overrides), storage=backend)  # type: ignore[arg-type]
    await cache.start()
    return cache


def assert_accounting(cache: HiCache) -> None:
    cache.sanity_check()


async def test_commit_attaches_storage_pages_and_a_match_reports_them(backend: MemoryBackend) -> None:
    """A fresh instance prefetches 32 stored tokens; commit attaches them as a host chain under the root."""
    cache = await open_cache(backend)
    try:
        seq = tokens(100, 32)
        await store_sequence(backend, cache, seq)
        prefetch = await cache.prefetch("r1", seq)
        assert prefetch is not None
        assert prefetch.num_tokens == 32
        outcome = await cache.commit_prefetch("r1")
        assert outcome.status == "committed"
        assert outcome.status is PrefetchStatus.COMMITTED
        assert (outcome.committed, outcome.dropped, outcome.drop_reason) == (True, False, None)
        assert (outcome.completed_tokens, outcome.loaded_tokens, outcome.released_tokens) == (32, 32, 0)
        match = cache.match(seq)
        assert (match.device_len, match.host_len) == (0, 32)
        host = tree_of(cache).node_info(match.host_nodes[-1]).host_value
        assert host is not None
        assert torch.equal(host_pool_of(cache).read_tokens(host), page_payload(as_key_bytes(seq)))
        assert_accounting(cache)
    finally:
        await cache.aclose()


async def test_acquire_loads_storage_hits_back_to_device_bitwise(backend: MemoryBackend) -> None:
    """acquire() = prefetch + commit + load back: the device pages hold exactly the stored KV."""
    cache = await open_cache(backend, prefetch_stop_policy="wait_complete")
    try:
        seq = tokens(7, 40)
        await store_sequence(backend, cache, seq)
        lease = await cache.acquire("r1", seq)
        assert lease.cached_len == 40
        assert lease.hit_tokens_by_tier == {"device": 0, "host": 0, "storage": 40}
        kv = cache.device_pool.read_tokens(lease.device_indices)
        assert torch.equal(kv, page_payload(as_key_bytes(seq)))
        cache.release(lease)
        await cache.wait_idle()
        assert_accounting(cache)
    finally:
        await cache.aclose()


async def test_commit_under_unbacked_parent_drops_the_refill_in_one_release_call(
    backend: MemoryBackend,
) -> None:
    """The seed (SGLang #31902): a refill whose attach point is device-only under write-through is dropped.

    The device-only node keeps no child, one release call carries every host page and every component
    transfer, and the tree stays sane.
    """
    cache = await open_cache(backend)
    try:
        seq = tokens(500, 48)
        await store_sequence(backend, cache, seq)
        # A device-only chain for the first 16 tokens whose backup has not run yet.
        device = cache.device_pool.alloc(16, Owner.TREE)  # handed straight to the tree
        assert device is not None
        tree_of(cache).insert(seq[:16], device)
        parent = cache.match(seq[:16]).last_device_node
        assert not tree_of(cache).node_info(parent).backed_up
        swa = host_pool_of(cache).alloc(2 * PAGE)
        assert swa is not None
        transfer = ComponentTransfer("swa", host_pool_of(cache), swa)
        release_queue_of(cache).history = []
        prefetch = await cache.prefetch("r1", seq, transfers=[transfer])
        assert prefetch is not None
        host_indices = prefetch.host_indices
        outcome = await cache.commit_prefetch("r1")
        assert outcome.status == "dropped"
        assert outcome.status is PrefetchStatus.DROPPED
        assert (outcome.dropped, outcome.committed) == (True, False)
        assert outcome.drop_reason is DropReason.ANCHOR_NOT_BACKED_UP
        assert outcome.loaded_tokens == 0
        assert prefetch.state is PrefetchState.DROPPED
        assert len(release_queue_of(cache).history) == 1
        release = release_queue_of(cache).history[0]
        assert torch.equal(release.host_indices, host_indices)
        assert release.transfers == (transfer,)
        assert tree_of(cache).node_info(parent).children == ()
        tree_of(cache).sanity_check()
        evicted = tree_of(cache).evict_device(10 * PAGE)
        cache.device_pool.free(evicted.freed_device, Owner.TREE)
        tree_of(cache).sanity_check()
        await release_queue_of(cache).drain()
        assert host_pool_of(cache).statistics().used_pages == tree_of(cache).statistics().host_tokens // PAGE
    finally:
        await cache.aclose()


async def test_write_back_keeps_the_refill_under_a_device_only_parent(backend: MemoryBackend) -> None:
    """Under write_back the same refill is attached below the un-backed parent."""
    cache = await open_cache(backend, write_policy="write_back")
    try:
        seq = tokens(500, 48)
        await store_sequence(backend, cache, seq)
        device = cache.device_pool.alloc(16, Owner.TREE)  # handed straight to the tree
        assert device is not None
        tree_of(cache).insert(seq[:16], device)
        outcome_prefetch = await cache.prefetch("r1", seq)
        assert outcome_prefetch is not None
        outcome = await cache.commit_prefetch("r1")
        assert outcome.status == "committed"
        assert outcome.loaded_tokens == 32
        assert outcome.released_tokens == 16  # the pages the tree already held
        match = cache.match(seq)
        assert (match.device_len, match.host_len) == (16, 32)
        await release_queue_of(cache).drain()
        assert_accounting(cache)
    finally:
        await cache.aclose()


async def test_best_effort_commit_keeps_only_the_pages_read_so_far(backend: MemoryBackend) -> None:
    """Committing mid-stream stops the reads: exactly the verified prefix is attached, the tail released."""
    gated = GatedBackend(backend)
    cache = await open_cache(gated, prefetch_stop_policy="best_effort")
    try:
        seq = tokens(1, 32)
        await store_sequence(backend, cache, seq)
        prefetch = await cache.prefetch("r1", seq)
        assert prefetch is not None
        gated.allow(5)  # two batches of two pages, and one page of the third batch
        while prefetch.completed_pages < 4:
            await prefetch.wait_progress()
        outcome = await cache.commit_prefetch("r1")
        assert (outcome.completed_tokens, outcome.loaded_tokens, outcome.released_tokens) == (16, 16, 16)
        assert gated.reads_started == gated.reads_done == 5
        assert cache.match(seq).host_len == 16
        await release_queue_of(cache).drain()
        assert_accounting(cache)
    finally:
        await cache.aclose()


async def test_wait_complete_commit_waits_for_every_page(backend: MemoryBackend) -> None:
    """wait_complete: commit returns only after the last page has been read."""
    gated = GatedBackend(backend)
    cache = await open_cache(gated, prefetch_stop_policy="wait_complete")
    try:
        seq = tokens(1, 32)
        await store_sequence(backend, cache, seq)
        await cache.prefetch("r1", seq)
        results = []
        async with anyio.create_task_group() as tg:

            async def commit() -> None:
                results.append(await cache.commit_prefetch("r1"))

            tg.start_soon(commit)
            await anyio.wait_all_tasks_blocked()
            for _ in range(8):
                assert not results
                gated.allow(1)
                await anyio.wait_all_tasks_blocked()
        assert results[0].loaded_tokens == 32
    finally:
        await cache.aclose()


async def test_a_one_batch_stream_reads_in_its_own_task(backend: MemoryBackend) -> None:
    """A prefetch whose pages fit one `get` batch reads them in its stream's task: no reader task and no
    task group to join per prefetch (each cost the loop a task step and a wake-up of the stream, issue 25).
    The pages still land and commit whole."""
    gated = GatedBackend(backend)
    cache = await open_cache(
        gated, storage_batch_pages=64, storage_concurrency=4, prefetch_stop_policy="wait_complete"
    )
    try:
        seq = tokens(3, 32)
        await store_sequence(backend, cache, seq)
        await anyio.wait_all_tasks_blocked()
        before = len(asyncio.all_tasks())
        prefetch = await cache.prefetch("r1", seq)
        assert prefetch is not None
        await anyio.wait_all_tasks_blocked()  # the stream waits in the gated `get`
        assert len(asyncio.all_tasks()) - before == 1, "the stream's own task, and no reader beside it"
        gated.allow(prefetch.num_tokens // PAGE)
        outcome = await cache.commit_prefetch("r1")
        assert (outcome.status, outcome.loaded_tokens) == (PrefetchStatus.COMMITTED, 32), outcome
        await release_queue_of(cache).drain()
        assert_accounting(cache)
    finally:
        await cache.aclose()


async def test_timeout_commit_gives_up_after_the_deadline(
    backend: MemoryBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """timeout: a stalled stream is stopped once min(max, base + per_1k * tokens) has passed.

    The deadline passes on the loop's clock once two pages landed and the commit waits: with a 50 ms real
    deadline, the lookup and the two reads raced it under load. The stalled read's own timeout lies beyond
    the clock's jump: two deadlines passing at once left the outcome to the order the loop woke the two
    tasks in (a stream reading in its own task ended a turn earlier than one reading in a child task).
    """
    loop_clock = LoopClock(monkeypatch)
    gated = GatedBackend(backend)
    cache = await open_cache(
        gated,
        prefetch_stop_policy="timeout",
        prefetch_timeout_base=60.0,
        prefetch_timeout_per_1k_tokens=0.0,
        storage_read_timeout_s=2 * HOUR_S,
    )
    try:
        seq = tokens(1, 32)
        await store_sequence(backend, cache, seq)
        prefetch = await cache.prefetch("r1", seq)
        assert prefetch is not None
        gated.allow(2)
        while prefetch.completed_pages < 2:
            await prefetch.wait_progress()
        outcomes: list[PrefetchOutcome] = []
        async with anyio.create_task_group() as tg:

            async def commit() -> None:
                outcomes.append(await cache.commit_prefetch("r1"))

            tg.start_soon(commit)
            await anyio.wait_all_tasks_blocked()
            assert not outcomes, "the commit waits for the stalled stream until the deadline"
            loop_clock.advance(HOUR_S)
        (outcome,) = outcomes
        assert prefetch.timed_out
        assert outcome.completed_tokens == 8
        assert outcome.loaded_tokens == 8
        await release_queue_of(cache).drain()
        assert_accounting(cache)
    finally:
        await cache.aclose()


async def test_second_commit_and_commit_after_cancel_raise_unknown_request(backend: MemoryBackend) -> None:
    """Misuse is an error that leaves the state unchanged."""
    cache = await open_cache(backend)
    try:
        seq = tokens(1, 32)
        await store_sequence(backend, cache, seq)
        await cache.prefetch("r1", seq)
        await cache.commit_prefetch("r1")
        with pytest.raises(UnknownRequest):
            await cache.commit_prefetch("r1")
        await cache.prefetch("r2", tokens(1, 64))  # 32 more tokens are not stored: a miss
        assert cache.statistics().prefetches_in_flight == 0
        with pytest.raises(UnknownRequest):
            await cache.cancel_prefetch("nope")
        with pytest.raises(ValueError, match="request_id"):
            await cache.prefetch("", seq)
        assert_accounting(cache)
    finally:
        await cache.aclose()


async def test_cancel_while_reads_are_in_flight_releases_only_after_io_stops(backend: MemoryBackend) -> None:
    """cancel_prefetch waits for the page being read, then releases every host page at once."""
    gated = GatedBackend(backend)
    cache = await open_cache(gated)
    try:
        seq = tokens(1, 32)
        await store_sequence(backend, cache, seq)
        prefetch = await cache.prefetch("r1", seq)
        assert prefetch is not None
        gated.allow(3)  # one batch of two pages, and one page of the next
        while prefetch.completed_pages < 2:
            await prefetch.wait_progress()
        outcome = await cache.cancel_prefetch("r1")
        assert outcome.status == "cancelled"
        assert gated.reads_started == gated.reads_done
        await release_queue_of(cache).drain()
        assert host_pool_of(cache).statistics().used_pages == 0
        assert_accounting(cache)
    finally:
        await cache.aclose()


@pytest.mark.parametrize("point", ["exists", "stream", "commit_wait", "acquire_commit"])
async def test_cancellation_at_every_await_point_leaves_nothing_behind(
    backend: MemoryBackend, point: str
) -> None:
    """Cancel the caller at each suspension point of prefetch and commit; then everything is accounted for."""
    gated = GatedBackend(backend)
    cache = await open_cache(gated, prefetch_stop_policy="wait_complete")
    try:
        seq = tokens(1, 32)
        await store_sequence(backend, cache, seq)
        if point == "exists":
            gated.exists_gate = anyio.Event()
            with anyio.move_on_after(0) as scope:
                await cache.prefetch("r1", seq)
            assert scope.cancelled_caught
            gated.exists_gate.set()
        elif point == "stream":
            prefetch = await cache.prefetch("r1", seq)
            assert prefetch is not None
            gated.allow(1)
            await anyio.wait_all_tasks_blocked()
            await cache.cancel_prefetch("r1")
        elif point == "commit_wait":
            await cache.prefetch("r1", seq)
            async with anyio.create_task_group() as tg:
                tg.start_soon(cache.commit_prefetch, "r1")
                await anyio.wait_all_tasks_blocked()
                tg.cancel_scope.cancel()
            assert cache.statistics().prefetches_in_flight == 1  # still there, asked to stop
            gated.allow(100)
            outcome = await cache.commit_prefetch("r1")
            assert outcome.status == "committed"
        else:
            async with anyio.create_task_group() as tg:
                tg.start_soon(cache.acquire, "r1", seq)
                await anyio.wait_all_tasks_blocked()
                gated.allow(2)
                await anyio.wait_all_tasks_blocked()
                tg.cancel_scope.cancel()
            gated.allow(100)
        await cache.wait_idle()
        assert cache.statistics().prefetches_in_flight == 0
        assert gated.reads_started == gated.reads_done
        assert_accounting(cache)
        assert (
            tree_of(cache).statistics().host_tokens + host_pool_of(cache).statistics().free_pages * PAGE
            == 64 * PAGE
        )
    finally:
        await cache.aclose()


@pytest.mark.parametrize("damage", ["flip", "truncate", "missing"])
async def test_damaged_page_ends_the_prefetch_there(backend: MemoryBackend, damage: str) -> None:
    """A corrupt, truncated or missing page at position 5 makes the prefetch 5 pages long, never wrong."""
    cache = await open_cache(backend, prefetch_stop_policy="wait_complete")
    try:
        seq = tokens(1, 40)
        keys = await store_sequence(backend, cache, seq)
        if damage == "flip":
            backend.corrupt(keys[5], offset=-3)
        elif damage == "truncate":
            backend.corrupt(keys[5], truncate=40)
        prefetch = await cache.prefetch("r1", seq)
        if damage == "missing":
            await backend.delete([keys[5]])
        assert prefetch is not None
        outcome = await cache.commit_prefetch("r1")
        assert outcome.completed_tokens == 20
        assert outcome.failed_pages == 1
        match = cache.match(seq)
        assert match.host_len == 20
        host = match.host_indices
        assert torch.equal(host_pool_of(cache).read_tokens(host), page_payload(as_key_bytes(seq[:20])))
        await release_queue_of(cache).drain()
        assert_accounting(cache)
    finally:
        await cache.aclose()


async def test_prefetch_is_skipped_below_threshold_and_over_capacity(backend: MemoryBackend) -> None:
    """Small remainders and prefetches beyond the in-flight capacity are skipped and counted."""
    cache = await open_cache(backend, prefetch_threshold=16, prefetch_capacity_tokens=40)
    try:
        await store_sequence(backend, cache, tokens(1, 64))
        assert await cache.prefetch("small", tokens(1, 12)) is None
        first = await cache.prefetch("big", tokens(1, 32))
        assert first is not None
        assert await cache.prefetch("over", tokens(1, 64)) is None
        text = render(cache.registry)
        assert 'reason="below_threshold"' in text
        assert 'reason="capacity"' in text
        await cache.cancel_prefetch("big")
    finally:
        await cache.aclose()


async def test_write_through_backs_up_and_writes_to_storage(backend: MemoryBackend) -> None:
    """A served request is backed up to host and written to storage; a second instance loads it bitwise."""
    cache = await open_cache(backend)
    seq = tokens(300, 36)
    try:
        await insert_device_chain(cache, seq)
        await cache.wait_idle()
        match = cache.match(seq)
        assert match.last_host_node is match.last_device_node
        assert await backend.exists([]) == 0
        assert_accounting(cache)
    finally:
        await cache.aclose()
    other = await open_cache(backend, prefetch_stop_policy="wait_complete")
    try:
        lease = await other.acquire("again", seq)
        assert lease.hit_tokens_by_tier["storage"] == 36
        kv = other.device_pool.read_tokens(lease.device_indices)
        assert torch.equal(kv, page_payload(as_key_bytes(seq)))
        other.release(lease)
    finally:
        await other.aclose()


async def test_info_log_names_dropped_or_committed(
    backend: MemoryBackend, caplog: pytest.LogCaptureFixture
) -> None:
    """Commit logs one info line with its figures."""
    cache = await open_cache(backend)
    try:
        seq = tokens(1, 32)
        await store_sequence(backend, cache, seq)
        await cache.prefetch("r1", seq)
        with caplog.at_level(logging.INFO, logger="hicache.cache"):
            await cache.commit_prefetch("r1")
        lines = [r.getMessage() for r in caplog.records if r.name == "hicache.cache"]
        assert lines == ["prefetch committed request=r1 completed=32 matched=32 loaded=32 released=0"]
    finally:
        await cache.aclose()


class BatchGatedBackend(PassThroughBackend):
    """Each `get` call (one batch) waits for its own gate; the test opens them in any order, and awaits
    `returned[i]` for batch i's read (in the memory backend's worker thread) to be back on the loop."""

    def __init__(self, inner: MemoryBackend) -> None:
        super().__init__(inner)
        self.gates: list[anyio.Event] = []
        self.returned: list[anyio.Event] = []
        self.fail: set[int] = set()
        self.cancelled: list[int] = []

    async def get(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[PageStatus]:
        index = len(self.gates)
        self.gates.append(anyio.Event())
        self.returned.append(anyio.Event())
        try:
            await self.gates[index].wait()
        except anyio.get_cancelled_exc_class():
            self.cancelled.append(index)
            raise
        ok = await self.inner.get(keys, buffers)
        self.returned[index].set()
        return [PageStatus.ERROR] * len(ok) if index in self.fail else ok

    async def open_gate(self, index: int) -> None:
        """Let batch `index` read, and return once its read is back and the loop has nothing left to run."""
        self.gates[index].set()
        await self.returned[index].wait()
        await anyio.wait_all_tasks_blocked()


async def test_concurrent_batches_count_only_the_verified_prefix(backend: MemoryBackend) -> None:
    """Batches finish out of order: pages count only once every page before them is in.

    A failed batch ends the stream at its first page and cancels the batches behind it.
    """
    gated = BatchGatedBackend(backend)
    cache = await open_cache(gated, storage_concurrency=3, prefetch_stop_policy="wait_complete")
    try:
        seq = tokens(1, 48)  # 12 pages, 6 batches of 2
        await store_sequence(backend, cache, seq)
        prefetch = await cache.prefetch("r1", seq)
        assert prefetch is not None
        await anyio.wait_all_tasks_blocked()
        assert len(gated.gates) == 3  # three batches in flight, no more
        await gated.open_gate(1)
        assert prefetch.completed_pages == 0  # batch 1 is in, but batch 0 is not
        await gated.open_gate(0)
        assert prefetch.completed_pages == 4
        assert len(gated.gates) == 5
        gated.fail.add(2)
        await gated.open_gate(2)
        with anyio.fail_after(30):  # the stream ends after deleting the failed pages (in a backend thread)
            await prefetch.wait_stopped()
        assert prefetch.completed_pages == 4
        assert sorted(gated.cancelled) == [3, 4]
        outcome = await cache.commit_prefetch("r1")
        assert (outcome.completed_tokens, outcome.loaded_tokens, outcome.failed_pages) == (16, 16, 1)
        match = cache.match(seq)
        host = match.host_indices
        assert torch.equal(host_pool_of(cache).read_tokens(host), page_payload(as_key_bytes(seq[:16])))
        await release_queue_of(cache).drain()
        assert_accounting(cache)
    finally:
        await cache.aclose()


async def test_a_page_deleted_behind_the_caches_back_is_written_again(backend: MemoryBackend) -> None:
    """The writer remembers pages it stored; a prefetch that finds one gone (here its probe) makes it forget
    them, so the next write-through of that path puts the page back (it would otherwise be skipped as
    known). The read-failure path is covered by the missed-hole test in test_storage_probe.py."""
    cache = await open_cache(backend, prefetch_stop_policy="wait_complete")
    seq = tokens(500, 36)  # 9 pages
    keys = [h.hex() for h in chained_page_hashes(as_key_bytes(seq), PAGE, cache.config.namespace, ROOT_HASH)]
    try:
        await insert_device_chain(cache, seq)
        await cache.wait_idle()
        assert await backend.exists(keys) == 9
        await backend.delete([keys[5]])
        # Forget the sequence: device copies go (they are backed up), then the host copies.
        everything = await cache.alloc_device(cache.device_pool.statistics().capacity_pages * PAGE)
        assert everything is not None
        cache.device_pool.free(everything)
        host_pool_of(cache).free(tree_of(cache).evict_host(len(seq)).freed_host, Owner.TREE)
        assert cache.match(seq).host_len == 0
        assert await cache.prefetch("again", seq) is not None
        outcome = await cache.commit_prefetch("again")
        assert (outcome.completed_tokens, outcome.failed_pages) == (5 * PAGE, 0)
        await insert_device_chain(cache, seq)  # serves it again: pages 5-8 are backed up and written
        await cache.wait_idle()
        assert await backend.exists(keys) == 9
        assert_accounting(cache)
    finally:
        await cache.aclose()
