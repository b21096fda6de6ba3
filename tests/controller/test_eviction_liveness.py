"""Eviction liveness (issue 10, finding 4): `alloc_device(n)` succeeds whenever free device pages plus the
unlocked, evictable ones can make room, under every write policy and any host size.

The stall this guards against: under write-back the tree promised a backup for each evicted leaf by its
own size, the controller then needed the leaf's whole un-backed chain on the host, which did not fit,
and gave up; and the host room counted host copies that host eviction cannot free.
"""

from __future__ import annotations

import anyio
import pytest
import torch
from cache_internals import host_pool_of, tree_of
from controller_helpers import insert_device_chain, make_config, tokens
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kv_oracle import layout_for

from hicache import HiCache, HiCacheConfig, Lease
from hicache.policy import WritePolicy


def room_for(cache: HiCache) -> int:
    """Device tokens `alloc_device` can have: free pages plus device pages of unlocked nodes."""
    free = cache.device_pool.statistics().free_pages * cache.page_size
    return free + tree_of(cache).statistics().evictable_device_tokens


@pytest.mark.parametrize("policy", list(WritePolicy), ids=lambda p: p.value)
async def test_two_children_of_a_shared_prefix_do_not_stall_a_small_host(policy: WritePolicy) -> None:
    """The reported repro: a 16-token parent with two 8-token children, a host of 16 tokens; asking for
    the whole device (48 tokens, 32 of them in unlocked nodes) must succeed, not return None."""
    async with HiCache(make_config(device_pages=12, host_pages=4, write_policy=policy)) as cache:
        await insert_device_chain(cache, tokens(0, 16) + tokens(100, 8))
        await insert_device_chain(cache, tokens(0, 16) + tokens(200, 8))
        await cache.wait_idle()
        assert tree_of(cache).statistics().evictable_device_tokens == 32
        assert room_for(cache) == 48

        got = await cache.alloc_device(48)

        assert got is not None
        assert got.numel() == 48
        cache.sanity_check(held_device_tokens=48)
        # The shared prefix is what fits on the host: it survives there (backed up at insert under
        # write-through, at eviction under write-back, where the children that did not fit were dropped).
        assert cache.match(tokens(0, 16)).host_len == 16
        # Write-through deleted the un-backed children; write-back dropped them: no host room for them.
        assert cache.metrics.evict_dropped_tokens.value() == 16
        cache.device_pool.free(got)
        cache.sanity_check()


@pytest.mark.parametrize("policy", list(WritePolicy), ids=lambda p: p.value)
async def test_a_host_of_one_page_never_blocks_device_eviction(policy: WritePolicy) -> None:
    """No chain fits in one host page: un-backed nodes are deleted or dropped, never waited on."""
    async with HiCache(make_config(device_pages=8, host_pages=1, write_policy=policy)) as cache:
        await insert_device_chain(cache, tokens(0, 16) + tokens(100, 8))
        await insert_device_chain(cache, tokens(0, 16) + tokens(200, 4))
        await cache.wait_idle()
        assert room_for(cache) == 32

        got = await cache.alloc_device(32)

        assert got is not None
        cache.sanity_check(held_device_tokens=32)
        cache.device_pool.free(got)


async def test_host_copies_of_locked_device_nodes_are_not_host_room() -> None:
    """A full host holding only the copy of a node on the device (leased) has no room for a backup: the
    un-backed leaf is dropped rather than promised a backup that cannot find host pages."""
    config = make_config(device_pages=12, host_pages=4, write_policy="write_back")
    async with HiCache(config) as cache:
        await insert_device_chain(cache, tokens(0, 16))
        room = await cache.alloc_device(48)  # backs the prefix up to the host (filling it), then demotes
        assert room is not None
        cache.device_pool.free(room)
        assert cache.match(tokens(0, 16)).host_len == 16
        lease = await cache.acquire("reader", tokens(0, 16))  # loads it back and locks it on the device
        assert lease.cached_len == 16
        await insert_device_chain(cache, tokens(500, 16))  # un-backed, unlocked
        stats = tree_of(cache).statistics()
        assert host_pool_of(cache).statistics().free_pages == 0
        assert stats.evictable_host_tokens == 16  # the leased node's host copy ...
        assert stats.reclaimable_host_tokens == 0  # ... which host eviction cannot free

        got = await cache.alloc_device(32)

        assert got is not None
        assert cache.match(tokens(500, 16)).device_len == 0  # dropped, not backed up
        assert cache.metrics.evict_dropped_tokens.value() == 16
        cache.sanity_check(held_device_tokens=32)
        cache.device_pool.free(got)
        cache.release(lease)
        cache.sanity_check()


# ---------------------------------------------------------------------- the liveness property

sequence = st.lists(st.integers(0, 1), min_size=1, max_size=3)
"""Pages drawn from two patterns, short: requests share and extend each other's prefixes."""
operation = st.one_of(
    st.tuples(st.just("serve"), sequence, st.booleans()),
    st.tuples(st.just("release"), st.integers(0, 1 << 16)),
    st.tuples(st.just("alloc"), st.integers(1, 9)),
)


def page_tokens(pages: list[int], page_size: int) -> list[int]:
    return [c * 100 + j for c in pages for j in range(page_size)]


class LivenessRun:
    """One example: random serving traffic, each device allocation checked against the room there is."""

    def __init__(self, cache: HiCache) -> None:
        self.cache = cache
        self.page = cache.page_size
        self.held: list[Lease] = []
        self.serial = 0

    async def alloc_checked(self, n: int) -> torch.Tensor | None:
        """`alloc_device(n)` must succeed exactly when free plus unlocked device tokens reach `n`."""
        cache = self.cache
        await cache.wait_idle()
        room = room_for(cache)
        got = await cache.alloc_device(n)
        assert (got is not None) == (room >= n), f"alloc_device({n}) -> {got is not None}, room {room}"
        cache.sanity_check(held_device_tokens=0 if got is None else int(got.numel()))
        return got

    async def serve(self, pages: list[int], hold: bool) -> None:
        cache = self.cache
        seq = page_tokens(pages, self.page)
        self.serial += 1
        lease = await cache.acquire(f"r{self.serial}", seq)
        new = await self.alloc_checked(len(seq) - lease.cached_len)
        if new is None:
            cache.release(lease)
            return
        await cache.insert(lease, seq, torch.cat([lease.device_indices, new]))
        if hold:
            self.held.append(await cache.acquire(f"h{self.serial}", seq))

    async def step(self, op: tuple[object, ...]) -> None:
        if op[0] == "serve":
            pages, hold = op[1], op[2]
            assert isinstance(pages, list)
            await self.serve(pages, bool(hold))
        elif op[0] == "release":
            if self.held:
                index = op[1]
                assert isinstance(index, int)
                self.cache.release(self.held.pop(index % len(self.held)))
        else:
            pages = op[1]
            assert isinstance(pages, int)
            got = await self.alloc_checked(pages * self.page)
            if got is not None:
                self.cache.device_pool.free(got)
        await self.cache.wait_idle()
        self.cache.sanity_check()


async def run_liveness(config: HiCacheConfig, ops: list[tuple[object, ...]]) -> None:
    async with HiCache(config) as cache:
        run = LivenessRun(cache)
        for op in ops:
            await run.step(op)
        for lease in run.held:
            cache.release(lease)
        # With nothing locked, the whole device can be had.
        total = cache.device_pool.statistics().capacity_pages * cache.page_size
        got = await run.alloc_checked(total)
        assert got is not None
        cache.device_pool.free(got)
        cache.sanity_check()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=st.sampled_from(list(WritePolicy)),
    page_size=st.sampled_from([1, 4]),
    device_pages=st.integers(2, 8),
    host_pages=st.integers(1, 8),
    ops=st.lists(operation, max_size=20),
)
def test_alloc_device_succeeds_whenever_unlocked_pages_make_room(
    policy: WritePolicy, page_size: int, device_pages: int, host_pages: int, ops: list[tuple[object, ...]]
) -> None:
    """Tiny pools, every write policy: after random serves (some holding a lease), releases and bare
    allocations, every `alloc_device(n)` returns indices exactly when free plus unlocked device tokens
    reach `n`; the tree and every pool stay exactly accounted for after each step."""
    config = make_config(
        layout=layout_for(page_size),
        device_pages=device_pages,
        host_pages=host_pages,
        write_policy=policy,
    )
    anyio.run(run_liveness, config, ops)
