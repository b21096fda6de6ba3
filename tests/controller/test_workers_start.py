"""Starting the background workers: a runner task that dies before the workers run fails `start()` with
a `HiCacheError` carrying its exception, instead of leaving `start()` waiting forever."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import anyio
import pytest
from cache_internals import component_pools_of, host_pool_of
from controller_helpers import make_config

from hicache import HiCache, HiCacheError, KVPool
from hicache.controller.workers import Workers
from storage_backends.memory import MemoryBackend


def every_pool(cache: HiCache) -> list[KVPool]:
    pools = [cache.device_pool, host_pool_of(cache)]
    for device_pool, host_pool in component_pools_of(cache).values():
        pools += [device_pool, host_pool]
    return pools


async def _raises_at_start(self: Workers, ready: anyio.Event) -> None:
    raise RuntimeError("the runner broke before the workers ran")


async def _cancelled_at_start(self: Workers, ready: anyio.Event) -> None:
    raise asyncio.CancelledError


@pytest.mark.timeout(60)  # before the fix, start() waited here until the suite's timeout
@pytest.mark.parametrize(
    ("runner", "cause"),
    [(_raises_at_start, RuntimeError), (_cancelled_at_start, type(None))],
    ids=["raises", "cancelled"],
)
async def test_a_runner_that_dies_before_the_workers_run_fails_start(
    monkeypatch: pytest.MonkeyPatch,
    runner: Callable[[Workers, anyio.Event], object],
    cause: type[BaseException] | type[None],
) -> None:
    """Guards against `start()` awaiting the runner's `ready` event with no bound: a runner that raised
    or was cancelled before setting it left `start()` (and `async with HiCache(...)`) hanging forever."""
    monkeypatch.setattr(Workers, "_run", runner)
    cache = HiCache(make_config(storage_url="memory://workers-start"))
    pools = every_pool(cache)
    with pytest.raises(HiCacheError, match=r"the workers task .* before the workers ran") as caught:
        await cache.start()
    assert isinstance(caught.value.__cause__, cause)
    if cause is RuntimeError:
        assert "the runner broke" in str(caught.value)
    # The failed start closed what it made, and closing again is immediate and quiet.
    assert all(pool.closed for pool in pools)
    assert isinstance(cache.storage, MemoryBackend)
    assert cache.storage.closed
    await cache.aclose()
    with pytest.raises(HiCacheError):
        await cache.start()  # closed for good
