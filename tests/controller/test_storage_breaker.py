"""The storage breaker inside the cache: lookups that hang or fail open it, and then prefetch and
write-through skip storage without calling it. Fake clocks (the breaker's, and the event loop's for the
deadlines); storage answers (or not) at gates. No real timing decides a result."""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import pytest
from controller_helpers import (
    HOUR_S,
    PAGE,
    LoopClock,
    PassThroughBackend,
    insert_device_chain,
    make_config,
    store_sequence,
    tokens,
)

from hicache import (
    BreakerState,
    CircuitBreaker,
    HiCache,
    HiCacheConfig,
    PageNotFound,
    SkipReason,
    StorageAuthError,
    StorageUnavailable,
)
from hicache.controller.storage.guarded import GuardedStorage
from hicache.errors import StorageCircuitOpen
from hicache.metrics import CollectorRegistry, default_cache_metrics, snapshot
from storage_backends.memory import MemoryBackend


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Flaky(PassThroughBackend):
    """A memory backend that hangs (`hang`) or fails (`down`) every call while told to; counts calls.

    A hung call blocks until it is cancelled; with a `LoopClock` it first lets an hour pass on the loop's
    clock, so the deadline around it fires at once.
    """

    def __init__(self, inner: MemoryBackend, loop_clock: LoopClock | None = None) -> None:
        super().__init__(inner)
        self.hang = False
        self.down = False
        self.calls = 0
        self._loop_clock = loop_clock

    async def _enter(self) -> None:
        self.calls += 1
        if self.down:
            raise StorageUnavailable("the test took storage down")
        if self.hang:
            if self._loop_clock is not None:
                self._loop_clock.advance(HOUR_S)
            await anyio.sleep_forever()

    async def exists(self, keys: Sequence[str]) -> int:
        await self._enter()
        return await self.inner.exists(keys)

    async def put(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[bool]:
        await self._enter()
        return await self.inner.put(keys, buffers)


def counter(cache: HiCache, name: str, **labels: str) -> float:
    """The value of hicache's series `name` (without its prefix) with `labels`, read from the registry."""
    value = cache.registry.get_sample_value(f"hicache_{name}", labels)
    return 0.0 if value is None else value


async def test_lookups_that_time_out_open_the_breaker_then_requests_skip_storage(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A storage that hangs: each lookup is cut by the prefetch deadline and counted as a `timeout`
    error (not a miss); after the threshold the breaker is open and lookups are not even started.

    The deadlines are long and the hung calls jump the loop's clock past them: with a 10 ms real deadline
    the lookup and reads of the recovered storage lost the race to it under load (a failure, once).
    """
    inner = MemoryBackend(namespace_digest=make_config().namespace.digest)
    storage = Flaky(inner, LoopClock(monkeypatch))
    clock = FakeClock()
    breaker = CircuitBreaker(threshold=2, backoff_initial_s=5.0, clock=clock)
    config = make_config(
        prefetch_timeout_base=60.0, prefetch_timeout_per_1k_tokens=0.0, backup_to_storage=False
    )
    async with inner, HiCache(config, storage=storage, storage_breaker=breaker) as cache:
        await store_sequence(inner, cache, tokens(0, 8 * PAGE))
        storage.hang = True
        for i in range(2):
            lease = await cache.acquire(f"hung-{i}", tokens(0, 8 * PAGE))
            assert lease.cached_len == 0
            assert lease.prefetch_skipped is SkipReason.STORAGE_ERROR
            cache.release(lease)
        assert breaker.state is BreakerState.OPEN
        assert counter(cache, "storage_errors_total", op="exists", kind="timeout") == 2
        assert counter(cache, "prefetch_skipped_total", reason="storage_error") == 2
        calls = storage.calls
        for i in range(5):
            lease = await cache.acquire(f"open-{i}", tokens(0, 8 * PAGE))
            assert lease.prefetch_skipped is SkipReason.STORAGE_UNAVAILABLE
            cache.release(lease)
        assert storage.calls == calls
        assert counter(cache, "prefetch_skipped_total", reason="storage_unavailable") == 5
        assert counter(cache, "prefetch_skipped_total", reason="storage_miss") == 0
        stats = cache.statistics().storage_breaker
        assert stats is not None
        assert stats.state is BreakerState.OPEN
        assert stats.opened == 1

        # The probe hangs too: it is cut by the deadline, counted as failed, and the backoff doubles.
        clock.now += 5.0
        lease = await cache.acquire("probe-1", tokens(0, 8 * PAGE))
        cache.release(lease)
        assert breaker.state is BreakerState.OPEN
        assert breaker.statistics().backoff_s == 10.0

        # Storage answers again: the next due probe closes the breaker and the prefetch loads the pages.
        storage.hang = False
        clock.now += 10.0
        lease = await cache.acquire("probe-2", tokens(0, 8 * PAGE))
        assert breaker.state is BreakerState.CLOSED
        assert lease.hit_tokens_by_tier["storage"] == 8 * PAGE
        cache.release(lease)
        await cache.wait_idle()
        cache.sanity_check()


async def test_write_through_is_shed_while_storage_is_down() -> None:
    """Backups still go to host, but their storage writes are shed (counted), not attempted, while the
    breaker is open; `exists`/`put` failures are `unavailable` errors."""
    inner = MemoryBackend(namespace_digest=make_config().namespace.digest)
    storage = Flaky(inner)
    breaker = CircuitBreaker(threshold=1, backoff_initial_s=20.0, clock=FakeClock())
    async with inner, HiCache(make_config(), storage=storage, storage_breaker=breaker) as cache:
        storage.down = True
        await insert_device_chain(cache, tokens(0, 4 * PAGE))
        await cache.wait_idle()
        assert breaker.state is BreakerState.OPEN
        assert counter(cache, "storage_errors_total", op="exists", kind="unavailable") == 1
        calls = storage.calls
        for i in range(1, 4):
            await insert_device_chain(cache, tokens(1000 * i, 4 * PAGE))
        await cache.wait_idle()
        assert storage.calls == calls
        # The first request's lookup opened the breaker, so its write-through was shed as well.
        assert counter(cache, "writes_shed_total", tier="storage", reason="storage_unavailable") == 4
        assert counter(cache, "storage_breaker_state", tier="storage") == BreakerState.OPEN
        assert cache.statistics().tree.host_tokens == 16 * PAGE, "backups to host went on"
        cache.sanity_check()


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("storage_breaker_threshold", 0, ValueError),
        ("storage_breaker_backoff_s", 0.0, ValueError),
        ("storage_breaker_backoff_max_s", 0.5, ValueError),
        ("backup_queue_limit", 0, ValueError),
        ("storage_write_queue_limit", "many", TypeError),
    ],
)
def test_bad_breaker_and_queue_settings_name_the_field(
    field: str, value: object, error: type[Exception]
) -> None:
    with pytest.raises(error, match=field):
        HiCacheConfig(**{**make_config().__dict__, field: value})


class Scripted(PassThroughBackend):
    """`exists` raises the next scripted exception (or answers when the script says None)."""

    def __init__(self, inner: MemoryBackend, script: list[BaseException | None]) -> None:
        super().__init__(inner)
        self.script = script
        self.calls = 0

    async def exists(self, keys: Sequence[str]) -> int:
        self.calls += 1
        step = self.script.pop(0)
        if step is not None:
            raise step
        return await self.inner.exists(keys)


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (StorageUnavailable("down"), "unavailable"),
        (StorageAuthError("403"), "auth"),
        (TimeoutError("slow"), "timeout"),
        (OSError(5, "EIO"), "other"),
    ],
)
async def test_the_guard_counts_errors_by_kind_and_misses_as_answers(error: OSError, kind: str) -> None:
    """An error opens the breaker (threshold 1) and is counted by kind; a `PageNotFound` is an answer
    (storage is up) that resets the count; while open the backend is not called at all."""
    inner = MemoryBackend(namespace_digest=make_config().namespace.digest)
    async with inner:
        backend = Scripted(inner, [PageNotFound("gone"), error])
        registry = CollectorRegistry()
        errors = default_cache_metrics(registry).storage_errors
        breaker = CircuitBreaker(threshold=1, backoff_initial_s=1.0, clock=FakeClock())
        guard = GuardedStorage(backend, breaker, errors)
        with pytest.raises(PageNotFound):
            await guard.exists(["00"])
        assert breaker.state is BreakerState.CLOSED
        with pytest.raises(type(error)):
            await guard.exists(["00"])
        assert breaker.state is BreakerState.OPEN
        assert errors.value(op="exists", kind=kind) == 1
        with pytest.raises(StorageCircuitOpen):
            await guard.exists(["00"])
        assert backend.calls == 2
        assert sum(s["value"] for s in snapshot(registry)["hicache_storage_errors_total"]["samples"]) == 1


async def test_a_cancelled_probe_backs_off_instead_of_probing_again_at_once() -> None:
    inner = MemoryBackend(namespace_digest=make_config().namespace.digest)
    async with inner:
        storage = Flaky(inner)
        clock = FakeClock()
        breaker = CircuitBreaker(threshold=1, backoff_initial_s=1.0, clock=clock)
        guard = GuardedStorage(storage, breaker, default_cache_metrics(CollectorRegistry()).storage_errors)
        storage.down = True
        with pytest.raises(StorageUnavailable):
            await guard.exists(["00"])
        storage.down, storage.hang = False, True
        clock.now += 1.0
        with anyio.move_on_after(0.01):
            await guard.exists(["00"])
        assert breaker.state is BreakerState.OPEN
        assert not breaker.allows()
        assert breaker.statistics().backoff_s == 2.0
