"""The sparse storage probe a prefetch sizes itself with, and what a hole it misses costs.

Guards the prefetch path's cost (an exact lookup stat-ed every page) and its safety: an overestimate from a
hole between probes must end the stream at the hole and hand every unread page back.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import anyio
import anyio.lowlevel
import pytest
from cache_internals import host_pool_of
from controller_helpers import PAGE, PassThroughBackend, make_config, page_payload, store_sequence, tokens

from hicache import HiCache
from hicache.controller.prefetch.admission import EXACT_BELOW, FANOUT, probe_hit_pages
from hicache.keys import Namespace, as_key_bytes
from storage_backends.cancellation import uncancellable
from storage_backends.memory import MemoryBackend


class CountingBackend(PassThroughBackend):
    """Records the number of keys of every `exists` call."""

    def __init__(self, inner: MemoryBackend) -> None:
        super().__init__(inner)
        self.exists_calls: list[int] = []

    async def exists(self, keys: Sequence[str]) -> int:
        self.exists_calls.append(len(keys))
        return await super().exists(keys)


@pytest.fixture
async def backend() -> AsyncIterator[MemoryBackend]:
    async with MemoryBackend(namespace_digest=Namespace().digest) as b:
        yield b


def page_keys(n: int) -> list[str]:
    return [f"{i:08x}" for i in range(n)]


async def hold(backend: MemoryBackend, keys: Sequence[str]) -> None:
    payload = memoryview(bytes(16))
    assert all(await backend.put(list(keys), [payload] * len(keys)))


@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 200, 1024, 1500])
async def test_the_probe_is_exact_when_storage_holds_a_prefix(backend: MemoryBackend, n: int) -> None:
    """Every prefix length of every size is found exactly, with a few calls of a few keys."""
    keys = page_keys(n)
    counting = CountingBackend(backend)
    held = 0
    for hit in sorted({0, 1, n // 3, n // 2 + 7, n - 1, n} & set(range(n + 1))):
        await hold(backend, keys[held:hit])
        held = hit
        counting.exists_calls.clear()
        assert await probe_hit_pages(counting, keys) == hit
        # Each call narrows the bracket FANOUT-fold; the last one checks at most EXACT_BELOW pages.
        assert sum(counting.exists_calls) <= EXACT_BELOW + (FANOUT + 1) * 3
        assert len(counting.exists_calls) <= 4


async def test_a_full_hit_costs_one_call_of_a_few_keys(backend: MemoryBackend) -> None:
    """1,024 stored pages: one call of at most FANOUT + 1 keys, where an exact lookup asks for 1,024."""
    keys = page_keys(1024)
    await hold(backend, keys)
    counting = CountingBackend(backend)
    assert await probe_hit_pages(counting, keys) == 1024
    assert len(counting.exists_calls) == 1
    assert counting.exists_calls[0] <= FANOUT + 1


async def test_a_hole_between_probes_is_overestimated(backend: MemoryBackend) -> None:
    """The documented trade: a hole no probe lands on is not seen (the stream's verification finds it)."""
    keys = page_keys(1024)
    await hold(backend, keys[:500] + keys[501:])
    assert await probe_hit_pages(backend, keys) == 1024
    assert await backend.exists(keys) == 500


async def test_bad_arguments_are_named(backend: MemoryBackend) -> None:
    with pytest.raises(ValueError, match="fanout"):
        await probe_hit_pages(backend, page_keys(4), fanout=1)
    with pytest.raises(ValueError, match="exact_below"):
        await probe_hit_pages(backend, page_keys(4), exact_below=0)


async def test_a_prefetch_over_a_missed_hole_stops_there_and_releases_the_rest(
    backend: MemoryBackend,
) -> None:
    """200 stored pages with page 150 deleted: the prefetch reserves 200, reads 150, releases the rest."""
    async with HiCache(
        make_config(host_pages=256, storage_batch_pages=8, prefetch_capacity_tokens=256 * PAGE),
        storage=backend,
    ) as cache:
        seq = tokens(1000, 200 * PAGE)
        keys = await store_sequence(backend, cache, seq)
        await backend.delete([keys[150]])
        prefetch = await cache.prefetch("r", seq)
        assert prefetch is not None
        assert prefetch.num_tokens == 200 * PAGE  # the probe missed the hole
        outcome = await cache.commit_prefetch("r")
        assert outcome.status == "committed"
        assert (outcome.completed_tokens, outcome.loaded_tokens) == (150 * PAGE, 150 * PAGE)
        assert outcome.released_tokens == 50 * PAGE
        assert outcome.failed_pages == 1
        match = cache.match(seq)
        assert (match.device_len, match.host_len) == (0, 150 * PAGE)
        host = host_pool_of(cache).read_tokens(match.host_indices)
        assert host.equal(page_payload(as_key_bytes(seq[: 150 * PAGE])))
        await cache.wait_idle()
        cache.sanity_check()
        stats = cache.statistics()
        assert stats.host_pool.used_pages == 150


class HeldProbe(PassThroughBackend):
    """`exists` calls after the first wait for `release`, then deliver any cancellation, as `to_thread` does."""

    def __init__(self, inner: MemoryBackend) -> None:
        super().__init__(inner)
        self.calls = 0
        self.second_call = anyio.Event()
        self.release = anyio.Event()

    async def exists(self, keys: Sequence[str]) -> int:
        self.calls += 1
        if self.calls >= 2:
            self.second_call.set()
            await uncancellable(self.release.wait())  # a cancellation lands when it returns, as with a thread
        return await super().exists(keys)


async def test_cancelling_a_prefetch_in_the_probes_second_call_leaves_nothing_behind(
    backend: MemoryBackend,
) -> None:
    """The probe's refining call is an await point of its own: cancelled there, the prefetch leaves no
    host page taken, no prefetch in flight and no anchor lock."""
    held = HeldProbe(backend)
    async with HiCache(
        make_config(host_pages=256, prefetch_capacity_tokens=256 * PAGE), storage=held
    ) as cache:
        seq = tokens(7000, 200 * PAGE)
        keys = await store_sequence(backend, cache, seq)
        await backend.delete(keys[120:])  # a partial hit: the probe must refine the bracket
        free_before = host_pool_of(cache).statistics().free_pages
        async with anyio.create_task_group() as tg:
            tg.start_soon(cache.prefetch, "r", seq)
            await held.second_call.wait()
            tg.cancel_scope.cancel()
            held.release.set()
        assert held.calls == 2
        assert cache.statistics().prefetches_in_flight == 0
        assert host_pool_of(cache).statistics().free_pages == free_before
        cache.sanity_check()
        # And the cache still serves the same request afterwards.
        held.calls = 0
        prefetch = await cache.prefetch("r", seq)
        assert prefetch is not None
        assert prefetch.num_tokens == 120 * PAGE
        assert (await cache.commit_prefetch("r")).loaded_tokens == 120 * PAGE
