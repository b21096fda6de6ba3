"""A background job that raises fails the cache loudly (issue 22, items 2 and 14, and the lifecycle traps).

Before: one exception in the release queue or a prefetch stream ended every background job in silence:
`statistics().closed` stayed False, the log said "shutdown interrupted", the next `prefetch()` raised
`AssertionError` with its anchor locked and its host pages held, and `wait_idle()` and
`commit_prefetch()` waited for ever. Now the failure is logged once, every later call raises
`CacheFailed`, what can be released is, no waiter hangs and `aclose()` finishes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import anyio
import pytest
import torch
from cache_internals import host_pool_of, release_queue_of, tree_of
from controller_helpers import GatedBackend, make_config, store_sequence, tokens

from hicache import CacheClosed, CacheFailed, HiCache, HiCacheError, UnsupportedEventLoop
from hicache.controller.prefetch.job import Prefetch
from hicache.errors import PoolError
from hicache.keys import Namespace
from storage_backends.memory import MemoryBackend


@pytest.fixture
async def backend() -> AsyncIterator[MemoryBackend]:
    async with MemoryBackend(namespace_digest=Namespace().digest) as b:
        yield b


def inject_double_free(cache: HiCache) -> None:
    """Hand the release queue a host page that is already free: its worker's `free` raises PoolError."""
    last = cache.config.host_pages - 1  # pages are handed out from the lowest: the last is free
    free_page = torch.arange(last * cache.page_size, (last + 1) * cache.page_size, dtype=torch.int64)
    release_queue_of(cache).release(free_page)


def failure_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.ERROR and "background job" in r.message]


async def test_a_failing_release_fails_the_cache_and_every_waiter_returns(
    backend: MemoryBackend, caplog: pytest.LogCaptureFixture
) -> None:
    """The issue's reproduction: a double free in the release queue while a prefetch streams (its commit
    waiting for it) and a `wait_idle` waits for the queue."""
    caplog.set_level(logging.WARNING, logger="hicache")
    gated = GatedBackend(backend)
    cache = HiCache(make_config(prefetch_stop_policy="wait_complete"), storage=gated)  # type: ignore[arg-type]
    await cache.start()
    seq = tokens(1, 32)
    await store_sequence(backend, cache, seq)
    prefetch = await cache.prefetch("r0", seq)
    assert prefetch is not None
    anchor = prefetch.anchor
    raised: dict[str, BaseException] = {}

    async def waits(name: str, call: object) -> None:
        try:
            await call  # type: ignore[misc]
        except HiCacheError as exc:
            raised[name] = exc

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waits, "commit", cache.commit_prefetch("r0"))
            await anyio.wait_all_tasks_blocked()
            inject_double_free(cache)
            tg.start_soon(waits, "wait_idle", cache.wait_idle())
        stats = cache.statistics()
        assert stats.closed
        assert stats.prefetches_in_flight == 0
        assert tree_of(cache).node_info(anchor).host_lock == 0
        assert isinstance(raised["commit"], CacheFailed)
        assert isinstance(raised["wait_idle"], CacheFailed)
        assert isinstance(raised["commit"].__cause__, PoolError)
        with pytest.raises(CacheFailed, match=r"^prefetch: .*PoolError"):
            await cache.prefetch("r1", seq)
        with pytest.raises(CacheFailed, match=r"^acquire: "):
            await cache.acquire("r2", seq)
        with pytest.raises(CacheFailed, match=r"^alloc_device: "):
            await cache.alloc_device(cache.page_size)
        with pytest.raises(CacheFailed, match=r"^wait_idle: "):
            await cache.wait_idle()
        await cache.aclose()
    assert len(failure_records(caplog)) == 1
    assert not [r for r in caplog.records if "shutdown interrupted" in r.message]
    assert release_queue_of(cache).statistics().released_tokens >= prefetch.num_tokens  # given back
    assert host_pool_of(cache).closed
    assert cache.device_pool.closed
    assert cache.statistics().closed
    with pytest.raises(CacheFailed, match=r"^start: "):
        await cache.start()


async def test_a_failing_prefetch_stream_fails_the_cache(
    backend: MemoryBackend, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream that raises (a bug, not a storage error: those end only the prefetch) fails the cache;
    the prefetch's pages go back and its anchor is unlocked before `aclose()`."""
    caplog.set_level(logging.WARNING, logger="hicache")

    async def broken_stream(self: Prefetch, *args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug in the stream")

    monkeypatch.setattr(Prefetch, "stream", broken_stream)
    cache = HiCache(make_config(), storage=backend)
    await cache.start()
    seq = tokens(1, 32)
    await store_sequence(backend, cache, seq)
    with anyio.fail_after(10):
        prefetch = await cache.prefetch("r0", seq)
        assert prefetch is not None
        await anyio.wait_all_tasks_blocked()
        assert cache.statistics().closed
        assert tree_of(cache).node_info(prefetch.anchor).host_lock == 0
        with pytest.raises(CacheFailed, match="a bug in the stream"):
            await cache.commit_prefetch("r0")
        await cache.aclose()
    assert len(failure_records(caplog)) == 1
    assert host_pool_of(cache).closed


async def test_acquire_on_a_cache_closed_during_the_call_names_acquire(backend: MemoryBackend) -> None:
    """Item 14: `acquire()` whose cache closes while its storage lookup is held raised errors naming
    inner steps (`prefetch: ...`, `request_id: ...`); now `CacheClosed` naming `acquire`."""
    gated = GatedBackend(backend)
    gated.exists_gate = anyio.Event()
    cache = HiCache(make_config(prefetch_stop_policy="wait_complete"), storage=gated)  # type: ignore[arg-type]
    await cache.start()
    seq = tokens(1, 32)
    await store_sequence(backend, cache, seq)
    errors: list[CacheClosed] = []

    async def request(request_id: str) -> None:
        try:
            await cache.acquire(request_id, seq)
        except CacheClosed as exc:
            errors.append(exc)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(request, "held-in-lookup")
            await anyio.wait_all_tasks_blocked()
            await cache.aclose()
            gated.exists_gate.set()
    assert [str(e).split(":")[0] for e in errors] == ["acquire"]
    assert not isinstance(errors[0], CacheFailed)


def test_a_start_cancelled_before_the_loop_ends_closes_the_pools() -> None:
    """Lifecycle trap: `start()` cancelled, and the loop ending right after, left the pools open (the
    workers' task, cancelled by the loop's shutdown, skipped closing them)."""
    cache = HiCache(make_config())

    async def main() -> None:
        task = asyncio.get_running_loop().create_task(cache.start())
        await asyncio.sleep(0)  # start() now waits for the workers to run
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert cache.device_pool.closed
    assert host_pool_of(cache).closed
    assert cache.statistics().closed


def test_a_cache_used_from_a_second_event_loop_is_refused_by_name() -> None:
    """Lifecycle trap: a cache started on one loop served `acquire` on another but never ran its backups
    there (`wait_idle` hung, `aclose` left the pools open). Now every call names the mistake, `aclose`
    there closes the pools (the first loop is not running), and the first loop, when it runs again,
    shuts the workers down."""
    first = asyncio.new_event_loop()
    try:
        cache = HiCache(make_config())
        first.run_until_complete(cache.start())  # the workers' task stays suspended on `first`

        async def second_loop() -> None:
            with pytest.raises(UnsupportedEventLoop, match=r"^acquire: .*another event loop"):
                await cache.acquire("r", tokens(1, 16))
            with pytest.raises(UnsupportedEventLoop, match=r"^alloc_device: "):
                await cache.alloc_device(cache.page_size)
            with pytest.raises(UnsupportedEventLoop, match=r"^wait_idle: "):
                await cache.wait_idle()
            with pytest.raises(UnsupportedEventLoop, match=r"^start: "):
                await cache.start()
            with anyio.fail_after(10):
                await cache.aclose()

        asyncio.run(second_loop())
        assert cache.device_pool.closed
        assert host_pool_of(cache).closed
        assert cache.statistics().closed
        first.run_until_complete(asyncio.wait_for(cache.aclose(), 10))  # the workers' shutdown ran
        assert cache._workers._shut_down.is_set()
    finally:
        first.close()
