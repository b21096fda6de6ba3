"""Deadlines with a stuck storage read: every call returns within its bound, stuck buffers are quarantined.

A read that never returns is made two ways: a real `FileBackend` whose worker thread, reading the batch of
one page, blocks before it reads (as in `open` on a hung NFS or FUSE mount) until the test lets it go, and
a `MemoryBackend` whose worker thread waits on a `threading.Event`. (A FIFO at a page's path no longer
does it: the file backend refuses a non-regular file without blocking, see `test_file_backend.py`.) Either way the caller's deadline (an anyio cancel scope or an asyncio
timeout) ends the call promptly; the host pages the stuck thread may still write into are quarantined (the
host pool never hands them out) until the thread returns, then released, and the accounting is exact.

Quarantine is asserted as "at least the stuck batch": a batch whose healthy read is still in its thread
when the deadline passes is quarantined too, until that thread returns a moment later.

No wall-clock bound is asserted: a call that returns "promptly" is one that returned while the stuck
read is still stuck (`returned` is set only once the stuck thread gets past its gate, which the test
opens later); `fail_after(BOUND_S)` only turns a hang into a failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path

import anyio
import anyio.lowlevel
import anyio.to_thread
import pytest
import torch
from cache_internals import host_pool_of, release_queue_of, tree_of
from kv_oracle import check_pools_exact, layout_for, page_keys, store_chain

from hicache import HiCache, HiCacheConfig
from hicache.keys import Namespace, as_key_bytes
from hicache.metrics import render
from storage_backends.file import FileBackend
from storage_backends.memory import MemoryBackend
from storage_backends.threads import stray_threads

PAGE = 4
N_PAGES = 12
BATCH = 3
STUCK_PAGE = 4
"""The stuck page's batch is pages 3-5: pages 0-2 read fine, pages 3-5 are under the stuck thread."""
LAYOUT = layout_for(PAGE)
NAMESPACE = HiCacheConfig(
    layout=LAYOUT, device_pages=1, host_pages=1, namespace=Namespace(model_id="deadlines")
).namespace
"""The effective namespace of every cache here (its config adds the layout to the model id)."""
SEQ = [3000 + 11 * i for i in range(N_PAGES * PAGE)]
KEY = as_key_bytes(SEQ)
BOUND_S = 30.0
"""A hang guard only (see the module docstring), never a figure the test checks."""


@pytest.fixture(autouse=True)
def _quiet_expected_warnings(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="storage_backends")
    caplog.set_level(logging.ERROR, logger="hicache")


def config(**overrides: object) -> HiCacheConfig:
    options: dict[str, object] = {
        "layout": LAYOUT,
        "device_pages": 32,
        "host_pages": 32,
        "namespace": NAMESPACE,
        "prefetch_threshold": PAGE,
        "prefetch_stop_policy": "wait_complete",
        "storage_batch_pages": BATCH,
        "storage_concurrency": 4,
        "backup_to_storage": False,
        "storage_read_timeout_s": 600.0,  # the caller's deadline decides, unless a test sets it
    }
    options.update(overrides)
    return HiCacheConfig(**options)  # type: ignore[arg-type]


class StuckFile:
    """One page's read stuck, as on a hung mount: the worker thread reading its batch blocks until
    `release()`, then reads as usual.

    `entered` is set by the backend's worker thread just before it blocks.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.returned = threading.Event()
        """Set once the stuck thread got past its gate: a call that returned before did not wait for it."""

    def block(self) -> None:
        """In the worker thread: say so, then wait until released (bounded: a failed test must end)."""
        self.entered.set()
        self.gate.wait(60)
        self.returned.set()

    def release(self) -> None:
        """Let every reader blocked on the page go."""
        self.gate.set()

    def remove(self) -> None:
        """Remove the page's file (the released read then finds it absent)."""
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    async def wait_entered(self) -> None:
        await anyio.to_thread.run_sync(self.entered.wait, 30)
        assert self.entered.is_set(), "no read reached the stuck page"


@pytest.fixture
async def stored(tmp_path: Path) -> AsyncIterator[FileBackend]:
    """A file backend holding the 12 pages of SEQ."""
    backend = FileBackend(tmp_path / "pages", namespace_digest=NAMESPACE.digest)
    try:
        await store_chain(backend, KEY, LAYOUT, NAMESPACE)
        yield backend
    finally:
        await backend.aclose()


@pytest.fixture
def stuck(stored: FileBackend, monkeypatch: pytest.MonkeyPatch) -> Iterator[StuckFile]:
    """Page STUCK_PAGE's read stuck; released, and its file removed, at teardown, whatever happened."""
    key = page_keys(KEY, LAYOUT, NAMESPACE)[STUCK_PAGE]
    fifo = StuckFile(stored.path_of(key))

    def before_read(keys: tuple[str, ...]) -> None:
        if key in keys:
            fifo.block()

    monkeypatch.setattr(stored, "_before_read", before_read)
    try:
        yield fifo
    finally:
        fifo.release()
        fifo.remove()


async def release_and_settle(cache: HiCache, fifo: StuckFile) -> None:
    """Let the stuck thread go, then wait until its pages left quarantine (within a generous bound)."""
    fifo.release()
    fifo.remove()
    with anyio.fail_after(30):
        while cache.statistics().quarantined_pages:  # noqa: ASYNC110 - the thread cannot wake the loop
            await anyio.sleep(0.01)
        await cache.wait_idle()


def failures(cache: HiCache) -> dict[str, float]:
    text = render(cache.registry)
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(r'^hicache_storage_page_failures_total\{reason="([a-z_]+)"\} (\S+)$', text, re.M)
    }


def quarantined_indices(cache: HiCache) -> set[int]:
    held = release_queue_of(cache).quarantined_host_indices()
    return set(torch.cat(held).tolist()) if held else set()


def assert_never_handed_out(cache: HiCache, quarantined: set[int]) -> torch.Tensor:
    """Take every free host page: none of them is quarantined, and nothing more can be had. Returns them."""
    free = host_pool_of(cache).statistics().free_pages * PAGE
    taken = host_pool_of(cache).alloc(free)
    assert taken is not None
    assert not quarantined & set(taken.tolist()), "a quarantined page was handed out"
    assert host_pool_of(cache).alloc(PAGE) is None
    return taken


async def assert_exact(cache: HiCache) -> None:
    """Releases carried out, then the cache is sane and every host page has exactly one owner."""
    await release_queue_of(cache).drain()
    cache.sanity_check()
    check_pools_exact(cache)


# ---------------------------------------------------------------------------------------------- file FIFO


async def test_a_fifo_at_a_page_path_fails_that_page_and_quarantines_nothing(stored: FileBackend) -> None:
    """A FIFO at a page's path used to block the reader thread in `open` for good: with no caller deadline
    the acquire hung, with one the read was abandoned and its host pages stayed quarantined forever. The
    backend's `exists` now finds no page there (a FIFO is no page file, issue 22 item 13), so the prefix
    ends before it and it is never read: acquire returns with the pages before it (no deadline needed; the
    bound only turns a hang into a failure), no page failed, nothing is quarantined and every page is
    accounted for. (`test_file_backend.py` checks that a `get` of it still refuses it without blocking.)"""
    key = page_keys(KEY, LAYOUT, NAMESPACE)[STUCK_PAGE]
    path = stored.path_of(key)
    path.unlink()
    os.mkfifo(path)
    async with HiCache(config(), storage=stored) as cache:
        with anyio.fail_after(BOUND_S):
            lease = await cache.acquire("r", SEQ)
        assert lease.cached_len == STUCK_PAGE * PAGE
        assert failures(cache) == {}
        assert cache.statistics().quarantined_pages == 0
        assert stray_threads.count == 0
        cache.release(lease)
        await assert_exact(cache)


async def test_acquire_returns_at_its_deadline_while_a_read_is_stuck(
    stored: FileBackend, stuck: StuckFile
) -> None:
    """acquire under `move_on_after(0.2)` returns within the bound although one batch's read never does.

    Guards against the shielded cleanup that waited for the stuck read (14 s for an 8 s deadline). The
    stuck batch's pages are quarantined: the host pool does not hand them out until the read returns;
    then they come back through the release queue and every page is accounted for.
    """
    async with HiCache(config(), storage=stored) as cache:
        with anyio.CancelScope() as deadline:
            async with anyio.create_task_group() as tg:

                async def deadline_passes_once_the_read_is_stuck() -> None:
                    await stuck.wait_entered()
                    deadline.cancel()

                tg.start_soon(deadline_passes_once_the_read_is_stuck)
                await cache.acquire("r", SEQ)
        assert deadline.cancelled_caught
        assert not stuck.returned.is_set(), "acquire waited for the stuck read"
        stats = cache.statistics()
        assert stats.prefetches_in_flight == 0
        # The stuck batch; on a loaded machine a batch still in its (healthy) thread may join it briefly.
        assert stats.quarantined_pages >= BATCH
        quarantined = quarantined_indices(cache)
        assert len(quarantined) == stats.quarantined_pages * PAGE
        await assert_exact(cache)
        taken = assert_never_handed_out(cache, quarantined)
        await release_and_settle(cache, stuck)
        assert cache.statistics().quarantined_pages == 0
        host_pool_of(cache).free(taken)
        await assert_exact(cache)
        everything = host_pool_of(cache).alloc(host_pool_of(cache).statistics().free_pages * PAGE)
        assert everything is not None
        assert quarantined <= set(everything.tolist()), "the quarantined pages came back"
        host_pool_of(cache).free(everything)
        await assert_exact(cache)


async def test_commit_prefetch_honours_an_asyncio_timeout(stored: FileBackend, stuck: StuckFile) -> None:
    """commit_prefetch inside `asyncio.timeout(0.2)` raises TimeoutError within the bound; the prefetch
    stays in flight (asked to stop) and cancel_prefetch then resolves it at once, quarantining the stuck
    batch."""
    async with HiCache(config(), storage=stored) as cache:
        assert await cache.prefetch("r", SEQ) is not None
        await stuck.wait_entered()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await cache.commit_prefetch("r")
        assert not stuck.returned.is_set(), "commit_prefetch waited for the stuck read"
        assert cache.statistics().prefetches_in_flight == 1
        outcome = await cache.cancel_prefetch("r")
        assert not stuck.returned.is_set(), "cancel_prefetch waited for the stuck read"
        assert outcome.status == "cancelled"
        assert outcome.quarantined_tokens >= BATCH * PAGE
        assert outcome.released_tokens == N_PAGES * PAGE
        await assert_exact(cache)
        taken = assert_never_handed_out(cache, quarantined_indices(cache))
        host_pool_of(cache).free(taken)
        await release_and_settle(cache, stuck)
        await assert_exact(cache)
        assert host_pool_of(cache).statistics().used_pages == 0


async def test_cancel_prefetch_returns_while_a_read_is_stuck(stored: FileBackend, stuck: StuckFile) -> None:
    """cancel_prefetch with a read blocked in the kernel: returns within the bound (it used to wait for
    the read), the stuck batch quarantined, the rest released at once."""
    async with HiCache(config(), storage=stored) as cache:
        assert await cache.prefetch("r", SEQ) is not None
        await stuck.wait_entered()
        with anyio.fail_after(BOUND_S):
            outcome = await cache.cancel_prefetch("r")
        assert not stuck.returned.is_set(), "cancel_prefetch waited for the stuck read"
        assert outcome.quarantined_tokens >= BATCH * PAGE
        assert cache.statistics().quarantined_pages >= BATCH
        assert stray_threads.count >= 1
        await assert_exact(cache)
        await release_and_settle(cache, stuck)
        await assert_exact(cache)
        assert host_pool_of(cache).statistics().used_pages == 0


async def test_a_read_past_the_read_timeout_fails_its_pages(stored: FileBackend, stuck: StuckFile) -> None:
    """With `storage_read_timeout_s=0.2` and no caller deadline, acquire returns the pages before the
    stuck batch; the timeout is counted (`reason="timeout"`) and the stuck batch quarantined."""
    async with HiCache(config(storage_read_timeout_s=0.2), storage=stored) as cache:
        with anyio.fail_after(0.2 + BOUND_S):
            lease = await cache.acquire("r", SEQ)
        assert not stuck.returned.is_set(), "acquire waited for the stuck read"
        assert lease.cached_len == (STUCK_PAGE // BATCH) * BATCH * PAGE
        assert lease.prefetch is not None
        assert lease.prefetch.failed_pages == 1
        assert failures(cache) == {"timeout": 1}
        cache.release(lease)
        assert cache.statistics().quarantined_pages >= BATCH
        await assert_exact(cache)
        await release_and_settle(cache, stuck)
        await assert_exact(cache)


async def test_aclose_is_bounded_and_keeps_the_pools_of_a_stuck_read_open(
    stored: FileBackend, stuck: StuckFile
) -> None:
    """aclose with a read stuck returns within `close_timeout_s` (it took 10.5 s); the host pool the
    stuck thread writes into stays open until the thread returns, then every pool the cache made closes."""
    cache = HiCache(config(close_timeout_s=0.2), storage=stored)
    await cache.start()
    assert await cache.prefetch("r", SEQ) is not None
    await stuck.wait_entered()
    await cache.aclose()
    assert not stuck.returned.is_set(), "aclose waited for the stuck read"
    assert cache.statistics().closed
    assert not host_pool_of(cache).closed, "a pool a stuck thread writes into was closed under it"
    assert cache.statistics().quarantined_pages >= BATCH
    stuck.release()
    with anyio.fail_after(30):
        while not host_pool_of(cache).closed:  # noqa: ASYNC110 - the shutdown finishes in its own task
            await anyio.sleep(0.01)
    assert cache.device_pool.closed
    await cache.aclose()  # idempotent, and at once now


# ------------------------------------------------------------------------------- thread waiting on event


class StuckMemory(MemoryBackend):
    """A memory backend whose worker thread, for the batch holding `stuck_key`, waits on `release`."""

    def __init__(self, stuck_key: str) -> None:
        super().__init__(namespace_digest=NAMESPACE.digest)
        self.stuck_key = stuck_key
        self.release = threading.Event()
        self.entered = threading.Event()
        self.returned = threading.Event()
        """Set once the stuck thread got past `release`: a call that returned before did not wait for it."""

    def _read_group(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int]:
        if self.stuck_key in keys:
            self.entered.set()
            self.release.wait(60)
            self.returned.set()
        return super()._read_group(keys, buffers)


@pytest.fixture
async def stuck_memory() -> AsyncIterator[StuckMemory]:
    backend = StuckMemory(page_keys(KEY, LAYOUT, NAMESPACE)[STUCK_PAGE])
    try:
        await store_chain(backend, KEY, LAYOUT, NAMESPACE)
        yield backend
    finally:
        backend.release.set()
        await backend.aclose()


async def settle_memory(cache: HiCache, backend: StuckMemory) -> None:
    backend.release.set()
    with anyio.fail_after(30):
        while cache.statistics().quarantined_pages:  # noqa: ASYNC110 - the thread cannot wake the loop
            await anyio.sleep(0.01)
        await cache.wait_idle()


async def test_acquire_under_asyncio_timeout_with_a_thread_stuck_on_an_event(
    stuck_memory: StuckMemory,
) -> None:
    """acquire inside `asyncio.timeout` that expires once the read is stuck raises TimeoutError within the
    bound; the batch the thread holds is quarantined and the host pool keeps it out of use until the
    event is set."""
    async with HiCache(config(), storage=stuck_memory) as cache:
        loop = asyncio.get_running_loop()

        async def acquire_until_the_read_is_stuck() -> None:
            async with asyncio.timeout(None) as timeout:

                async def expire_once_the_read_is_stuck() -> None:
                    await anyio.to_thread.run_sync(stuck_memory.entered.wait, 30)
                    timeout.reschedule(loop.time())

                helper.append(asyncio.create_task(expire_once_the_read_is_stuck()))
                await cache.acquire("r", SEQ)

        helper: list[asyncio.Task[None]] = []
        with pytest.raises(TimeoutError):
            await acquire_until_the_read_is_stuck()
        await helper[0]
        assert not stuck_memory.returned.is_set(), "acquire waited for the stuck read"
        assert stuck_memory.entered.is_set()
        assert cache.statistics().quarantined_pages >= BATCH
        await assert_exact(cache)
        taken = assert_never_handed_out(cache, quarantined_indices(cache))
        host_pool_of(cache).free(taken)
        await settle_memory(cache, stuck_memory)
        await assert_exact(cache)
        assert host_pool_of(cache).statistics().used_pages == 0
        # The cache serves the request in full once the storage recovers.
        lease = await cache.acquire("again", SEQ)
        assert lease.cached_len == N_PAGES * PAGE
        cache.release(lease)
        await assert_exact(cache)


async def test_aclose_under_asyncio_wait_for_with_a_thread_stuck_on_an_event(
    stuck_memory: StuckMemory,
) -> None:
    """aclose inside `asyncio.wait_for` shorter than `close_timeout_s`: TimeoutError (not CancelledError)
    within the bound; the cache is closed and finishes closing once the thread returns."""
    cache = HiCache(config(close_timeout_s=60.0), storage=stuck_memory)
    await cache.start()
    assert await cache.prefetch("r", SEQ) is not None
    await anyio.to_thread.run_sync(stuck_memory.entered.wait, 30)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(cache.aclose(), 0.2)
    assert not stuck_memory.returned.is_set(), "aclose waited for the stuck read"
    assert cache.statistics().closed
    assert not host_pool_of(cache).closed
    await anyio.lowlevel.checkpoint()  # this task is not left cancelled
    stuck_memory.release.set()
    with anyio.fail_after(30):
        await cache.aclose()
    assert host_pool_of(cache).closed
    assert cache.statistics().quarantined_pages == 0


# ------------------------------------------------------------------------------------- write-through


class StuckWrites(MemoryBackend):
    """A memory backend whose worker thread, for every `put`, waits on `release` first."""

    def __init__(self) -> None:
        super().__init__(namespace_digest=NAMESPACE.digest)
        self.release = threading.Event()
        self.entered = threading.Event()

    def _write_group(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int]:
        self.entered.set()
        self.release.wait(60)
        return super()._write_group(keys, buffers)


async def test_a_write_past_the_write_timeout_keeps_its_pages_locked_until_the_thread_returns() -> None:
    """A write-through `put` stuck past `storage_write_timeout_s` is counted (`write_timeout`) and
    abandoned; the host pages its thread still reads stay locked (not evictable) until it returns."""
    backend = StuckWrites()
    try:
        cfg = config(backup_to_storage=True, storage_write_timeout_s=0.2)
        async with HiCache(cfg, storage=backend) as cache:
            lease = await cache.acquire("r", SEQ)
            new = await cache.alloc_device(len(SEQ))
            assert new is not None
            await cache.insert(lease, SEQ, new)
            with anyio.fail_after(0.2 + BOUND_S):
                await cache.wait_idle()
            assert backend.entered.is_set()
            assert failures(cache) == {"write_timeout": N_PAGES}
            node = cache.match(SEQ).last_host_node
            assert tree_of(cache).node_info(node).host_lock > 0, "pages a stray write reads were unlocked"
            assert cache.statistics().release_queue.quarantined_calls == 1
            assert cache.statistics().quarantined_pages == 0  # still the tree's pages, only locked
            await assert_exact(cache)
            backend.release.set()
            with anyio.fail_after(30):
                while cache.statistics().release_queue.quarantined_calls:  # noqa: ASYNC110 - a thread
                    await anyio.sleep(0.01)
            assert tree_of(cache).node_info(node).host_lock == 0
            await assert_exact(cache)
    finally:
        backend.release.set()
        await backend.aclose()


async def test_an_s3_tier_opened_from_its_url_gets_the_cache_timeouts_as_its_deadlines() -> None:
    """`storage_url="s3://..."` opens the S3 backend with the cache's read and write timeouts as its
    per-request deadlines (the client gives up by itself, not only when cancelled)."""
    pytest.importorskip("obstore")
    cfg = config(
        storage_url="s3://bucket/prefix?endpoint=http://127.0.0.1:9&region=us-east-1",
        storage_options={"access_key_id": "test", "secret_access_key": "test"},
        storage_read_timeout_s=0.75,
        storage_write_timeout_s=1.5,
    )
    async with HiCache(cfg) as cache:
        storage = cache.storage
        assert storage is not None
        assert storage._requests._read_deadline_s == 0.75  # type: ignore[attr-defined]
        assert storage._requests._write_deadline_s == 1.5  # type: ignore[attr-defined]
