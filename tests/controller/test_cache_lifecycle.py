"""Closing a HiCache: every pool it made is closed, last; pools the caller passed in stay the caller's."""

from __future__ import annotations

import asyncio
import gc
import warnings
from collections.abc import AsyncIterator, Sequence

import anyio
import pytest
from cache_internals import component_pools_of, host_pool_of
from controller_helpers import LAYOUT, PassThroughBackend, make_config, store_sequence, tokens

from hicache import HiCache, KVLayout, UnsupportedEventLoop
from hicache.components import MambaState, SlidingWindow
from hicache.controller.movement import copies as copies_module
from hicache.controller.pages import allocation as allocation_module
from hicache.keys import Namespace
from hicache.memory import KVPool, make_device_pool, make_host_pool
from hicache.tree import MatchResult
from storage_backends.cancellation import uncancellable
from storage_backends.memory import MemoryBackend
from storage_backends.protocol import PageStatus


@pytest.fixture
async def backend() -> AsyncIterator[MemoryBackend]:
    async with MemoryBackend(namespace_digest=Namespace().digest) as b:
        yield b


def hybrid_components() -> tuple[SlidingWindow, MambaState]:
    return (
        SlidingWindow(8, KVLayout.flat(8, LAYOUT.page_size), device_pages=4, host_pages=4),
        MambaState(16, device_slots=2, host_slots=2),
    )


def every_pool(cache: HiCache) -> list[KVPool]:
    pools = [cache.device_pool, host_pool_of(cache)]
    for device_pool, host_pool in component_pools_of(cache).values():
        pools += [device_pool, host_pool]
    return pools


class HeldReads(PassThroughBackend):
    """Reads that, once started, finish only when `finish` is set, cancelled or not (like a worker thread).

    Each read records whether any of `watched` was closed when it returned.
    """

    def __init__(self, inner: MemoryBackend) -> None:
        super().__init__(inner)
        self.started = anyio.Event()
        self.finish = anyio.Event()
        self.watched: list[KVPool] = []
        self.closed_at_return: list[bool] = []

    async def get(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[PageStatus]:
        self.started.set()

        async def read() -> list[PageStatus]:
            await self.finish.wait()
            return await self.inner.get(keys, buffers)

        try:
            return await uncancellable(read())
        finally:
            self.closed_at_return.append(any(pool.closed for pool in self.watched))


async def test_aclose_closes_every_pool_the_cache_made() -> None:
    """Base and component pools, device and host, are all closed once `async with` exits."""
    async with HiCache(make_config(components=hybrid_components())) as cache:
        pools = every_pool(cache)
        assert len(pools) == 6
        assert not any(pool.closed for pool in pools)
    assert all(pool.closed for pool in pools)
    await cache.aclose()  # idempotent
    assert all(pool.closed for pool in pools)


async def test_a_cache_closed_without_starting_closes_its_pools() -> None:
    """A cache built and closed without `start()` still gives its pools back."""
    cache = HiCache(make_config(components=hybrid_components()))
    pools = every_pool(cache)
    await cache.aclose()
    assert all(pool.closed for pool in pools)


async def test_pools_passed_in_stay_open_for_their_owner() -> None:
    """The cache closes only what it made: the caller's pools outlive it and the caller closes them."""
    config = make_config()
    with (
        make_device_pool(config.layout, config.device_pages, name="mine-device") as device_pool,
        make_host_pool(config.layout, config.host_pages, name="mine-host") as host_pool,
    ):
        async with HiCache(config, device_pool=device_pool, host_pool=host_pool) as cache:
            assert cache.device_pool is device_pool
            assert host_pool_of(cache) is host_pool
        assert not device_pool.closed
        assert not host_pool.closed
    assert device_pool.closed
    assert host_pool.closed


async def test_pools_close_only_after_reads_in_flight_returned(backend: MemoryBackend) -> None:
    """aclose closes the pools last: a storage read that was writing into host pages returns first.

    Guards against freeing the host pool's buffer while a prefetch's read may still fill it.
    """
    held = HeldReads(backend)
    steps: list[str] = []
    seen_while_held: list[bool] = []

    async def finish_the_read_once_aclose_waits() -> None:
        await held.started.wait()
        await anyio.wait_all_tasks_blocked()
        seen_while_held.append(any(pool.closed for pool in held.watched))
        steps.append("read released")
        held.finish.set()

    seq = tokens(1, 16)
    async with anyio.create_task_group() as tg:
        tg.start_soon(finish_the_read_once_aclose_waits)
        async with HiCache(make_config(), storage=held) as cache:
            await store_sequence(backend, cache, seq)
            held.watched = every_pool(cache)
            assert await cache.prefetch("r1", seq) is not None
            await held.started.wait()
            steps.append("aclose called")
        steps.append("aclose returned")
    assert steps == ["aclose called", "read released", "aclose returned"]
    assert seen_while_held == [False]
    assert held.closed_at_return == [False]
    assert all(pool.closed for pool in held.watched)


async def test_a_failed_constructor_closes_the_pools_it_made(monkeypatch: pytest.MonkeyPatch) -> None:
    """When making a pool fails (out of memory), the pools made before it are closed, not leaked."""
    made: list[KVPool] = []

    def recording_device_pool(layout: KVLayout, num_pages: int, *, name: str = "device") -> KVPool:
        made.append(make_device_pool(layout, num_pages, name=name))
        return made[-1]

    def failing_host_pool(layout: KVLayout, num_pages: int, *, name: str = "host") -> KVPool:
        if name == "host":
            raise MemoryError("host pool: out of memory")
        made.append(make_host_pool(layout, num_pages, name=name))
        return made[-1]

    monkeypatch.setattr(allocation_module, "make_device_pool", recording_device_pool)
    monkeypatch.setattr(allocation_module, "make_host_pool", failing_host_pool)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(MemoryError, match="host pool"):
            HiCache(make_config(components=hybrid_components()))
        gc.collect()
    assert [pool.name for pool in made] == ["swa-device", "swa-host", "mamba-device", "mamba-host", "device"]
    assert all(pool.closed for pool in made)
    assert [w for w in caught if issubclass(w.category, ResourceWarning)] == []


async def test_a_mismatched_pool_is_refused_before_any_pool_is_made() -> None:
    """A caller's pool of another layout raises ValueError naming it; the cache made nothing to leak."""
    config = make_config()
    other = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, dtype=LAYOUT.dtype, page_size=LAYOUT.page_size)
    with make_host_pool(other, 4, name="wrong") as wrong:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(ValueError, match="host_pool: layout"):
                HiCache(config, host_pool=wrong)
            gc.collect()
        assert not wrong.closed
    assert [w for w in caught if issubclass(w.category, ResourceWarning)] == []


async def test_pools_close_only_after_a_callers_load_back_copy_landed(
    backend: MemoryBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """aclose from one task while another task's load_back copy is in flight: the pools stay open until
    the copy has landed (a CUDA copy still writing into a freed device buffer would corrupt other memory).
    """
    real_copy = copies_module.copy_pages_async
    copy_started = anyio.Event()
    finish_copy = anyio.Event()
    closed_when_copy_returned: list[bool] = []

    async def held_copy(*args: object, **kwargs: object) -> None:
        copy_started.set()

        async def copy() -> None:
            await finish_copy.wait()
            await real_copy(*args, **kwargs)  # type: ignore[arg-type]

        await uncancellable(copy())  # like a real copy: never abandoned mid-flight
        closed_when_copy_returned.append(any(pool.closed for pool in pools))

    seq = tokens(1, 16)
    steps: list[str] = []
    seen_while_held: list[bool] = []
    cache = HiCache(make_config(), storage=backend)
    pools = every_pool(cache)

    async def serve(match: MatchResult) -> None:
        await cache.load_back(match)  # finishes its bookkeeping once the copy has landed
        steps.append("load_back returned")

    async def release_the_copy_once_aclose_waits() -> None:
        await anyio.wait_all_tasks_blocked()
        seen_while_held.append(any(pool.closed for pool in pools))
        steps.append("copy released")
        finish_copy.set()

    # The request's task group is older than the cache's, which `aclose` exits in this same task.
    async with anyio.create_task_group() as tg:
        async with cache:
            await store_sequence(backend, cache, seq)
            assert await cache.prefetch("r1", seq) is not None
            assert (await cache.commit_prefetch("r1")).status == "committed"
            match = cache.match(seq)
            assert match.host_len == 16
            monkeypatch.setattr(copies_module, "copy_pages_async", held_copy)
            tg.start_soon(serve, match)
            await copy_started.wait()
            tg.start_soon(release_the_copy_once_aclose_waits)
            steps.append("aclose called")
        steps.append("aclose returned")
    assert seen_while_held == [False]
    assert steps[:2] == ["aclose called", "copy released"]
    assert sorted(steps[2:]) == ["aclose returned", "load_back returned"]
    assert closed_when_copy_returned == [False]
    assert all(pool.closed for pool in pools)


def test_a_cache_started_outside_asyncio_is_refused_by_name() -> None:
    """Driven by another event loop (trio through anyio, or none: here the coroutine is stepped by hand),
    `start` raises `UnsupportedEventLoop` before it opens anything, instead of failing later inside the
    read threads' eventfd watch or the pacer; the cache can still be closed cleanly."""
    cache = HiCache(make_config())
    step = cache.start()
    with pytest.raises(UnsupportedEventLoop, match="asyncio"):
        step.send(None)
    assert not cache.statistics().prefetches_in_flight
    asyncio.run(cache.aclose())
    assert all(pool.closed for pool in every_pool(cache))
