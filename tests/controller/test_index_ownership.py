"""Index misuse: `insert`, `release` and component inserts take only pages the caller holds.

A page index handed to the cache must be one the caller got from `alloc_device` / `alloc_component` (or
its lease's own prefix) and still holds. Every other kind of index (out of range, negative, misaligned,
repeated, never allocated, freed, held by the tree, another lease's prefix, an index of the host pool) is
refused with an error naming the argument, and nothing changes: pools (statistics and owner tags), tree
and lease are exactly as before, `sanity_check()` passes, and the cache then serves correct KV. Guards
against the cache handing one page to two owners and serving another request's KV (issue 9, finding 1).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import anyio
import pytest
import torch
from cache_internals import component_pools_of, host_pool_of, tree_of
from controller_helpers import (
    PAGE,
    PassThroughBackend,
    insert_device_chain,
    make_config,
    page_payload,
    tokens,
)

from hicache import HiCache
from hicache.errors import PoolError
from hicache.keys import as_key_bytes
from hicache.memory import KVPool, Owner
from storage_backends.memory import MemoryBackend
from storage_backends.protocol import PageStatus

DEVICE_TOKENS = 32 * PAGE  # make_config: 32 device pages, 64 host pages


def open_cache() -> HiCache:
    """A small cache without storage (write-through to host); open it with `async with` in the test."""
    return HiCache(make_config())


def pools(cache: HiCache) -> dict[str, KVPool]:
    out = {"device": cache.device_pool, "host": host_pool_of(cache)}
    for name, (device, host) in component_pools_of(cache).items():
        out[f"{name}-device"], out[f"{name}-host"] = device, host
    return out


def snapshot(cache: HiCache) -> tuple[Any, ...]:
    """Everything a refused call must leave unchanged: statistics, every page's owner, every node."""

    def as_list(t: torch.Tensor | None) -> list[int] | None:
        return None if t is None else t.tolist()

    tree = tree_of(cache)
    nodes = sorted(
        (
            n.key,
            as_list(n.device_value),
            as_list(n.host_value),
            as_list(n.backup_pending),
            n.device_lock,
            n.host_lock,
            n.hit_count,
            n.last_access,
            sorted(
                (name, as_list(d.device_value), as_list(d.host_value), d.device_lock, d.host_lock)
                for name, d in tree.component_info(n.ref).items()
            ),
        )
        for n in map(tree.node_info, tree.iter_nodes())
    )
    tags = {name: pool.owner_tags().tolist() for name, pool in pools(cache).items()}
    return cache.statistics(), nodes, tags


def run(start: int) -> torch.Tensor:
    """The token indices of the pages starting at token `start` (one page)."""
    return torch.arange(start, start + PAGE, dtype=torch.int64)


async def fill(cache: HiCache, seq: list[int]) -> None:
    """Serve `seq` fully (acquire, compute, insert) and let its backups settle."""
    await insert_device_chain(cache, seq)
    await cache.wait_idle()


def assert_serves(cache: HiCache, seq: list[int], indices: torch.Tensor) -> None:
    """The device pages at `indices` hold exactly the KV of `seq`."""
    assert torch.equal(cache.device_pool.read_tokens(indices), page_payload(as_key_bytes(seq)))


async def check_workload_after(cache: HiCache, seqs: Sequence[list[int]]) -> None:
    """A following workload: every sequence served again reads back its own KV, and pools stay sound."""
    for i, seq in enumerate(seqs):
        lease = await cache.acquire(f"after-{i}", seq)
        aligned = len(seq) // PAGE * PAGE
        assert lease.cached_len == aligned
        assert_serves(cache, seq[:aligned], lease.device_indices)
        cache.release(lease)
    extra = tokens(9000, 6 * PAGE + 1)
    await fill(cache, extra)
    lease = await cache.acquire("after-extra", extra)
    assert_serves(cache, extra[: lease.cached_len], lease.device_indices)
    cache.release(lease)
    await cache.wait_idle()
    cache.sanity_check()


# Each case maps (the request's new pages, context) to a bad tensor to pass in their place, where the
# context holds pages of other owners: a page the tree holds, another lease's prefix, freed pages and a
# host index beyond the device pool.
BadIndices = Callable[[torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]
BAD_DEVICE_INDICES: dict[str, BadIndices] = {
    "out_of_range": lambda new, ctx: torch.cat([new[:-PAGE], run(DEVICE_TOKENS)]),
    "far_out_of_range": lambda new, ctx: torch.cat([new[:-PAGE], run(2**40)]),
    "negative": lambda new, ctx: torch.cat([new[:-PAGE], run(-PAGE)]),
    "misaligned": lambda new, ctx: new + 1,
    "not_a_whole_page_run": lambda new, ctx: torch.cat([new[:-PAGE], new[-PAGE:].flip(0)]),
    "duplicated_within_the_call": lambda new, ctx: torch.cat([new[:-PAGE], new[:PAGE]]),
    "never_allocated": lambda new, ctx: torch.cat([new[:-PAGE], ctx["free"]]),
    "already_in_the_tree": lambda new, ctx: torch.cat([new[:-PAGE], ctx["tree"]]),
    "another_leases_prefix": lambda new, ctx: torch.cat([new[:-PAGE], ctx["other_prefix"]]),
    "freed": lambda new, ctx: torch.cat([new[:-PAGE], ctx["freed"]]),
    "host_pool_index": lambda new, ctx: torch.cat([new[:-PAGE], ctx["host"]]),
    "host_pool_index_past_the_device_pool": lambda new, ctx: torch.cat([new[:-PAGE], run(40 * PAGE)]),
}


async def misuse_setup(cache: HiCache) -> tuple[Any, list[int], torch.Tensor, dict[str, torch.Tensor]]:
    """A tree holding two sequences (one leased by another request), and a request `r` that extends the
    first by 3 pages and 1 token, holding its lease and 4 freshly allocated pages."""
    a, b = tokens(100, 4 * PAGE), tokens(500, 4 * PAGE)
    await fill(cache, a)
    await fill(cache, b)
    other = await cache.acquire("other", b)
    assert other.cached_len == 4 * PAGE
    seq = a + tokens(2000, 3 * PAGE + 1)
    lease = await cache.acquire("r", seq)
    assert lease.cached_len == 4 * PAGE
    new = await cache.alloc_device(4 * PAGE)
    assert new is not None
    cache.device_pool.write_tokens(new[: 3 * PAGE + 1], page_payload(as_key_bytes(seq[4 * PAGE :])))
    freed = await cache.alloc_device(PAGE)
    assert freed is not None
    cache.release(other, freed)  # gives the pages back: freed from here on (and drops the lease)
    other = await cache.acquire("other-again", b)
    held_by_tree = cache.match(a).device_indices[-PAGE:]
    used = set((cache.device_pool.owner_tags() != Owner.FREE).nonzero().flatten().tolist())
    free_page = next(p for p in range(32) if p not in used)
    host_value = tree_of(cache).node_info(cache.match(b).last_device_node).host_value
    assert host_value is not None  # backed up under write-through
    host = host_value[-PAGE:]  # the host pool's index of one of b's pages
    assert not set(host.tolist()) & set(new.tolist())  # not numerically one of the caller's own pages
    ctx = {
        "tree": held_by_tree,
        "other_prefix": other.device_indices[-PAGE:],
        "freed": freed,
        "free": run(free_page * PAGE),
        "host": host,
    }
    return lease, seq, new, ctx


@pytest.mark.parametrize("kind", sorted(BAD_DEVICE_INDICES))
async def test_insert_refuses_device_indices_the_caller_does_not_hold(kind: str) -> None:
    """`insert` with one bad page among the request's own: refused naming `device_indices`, nothing changes,
    and the same request then inserts its real pages and every sequence reads back its own KV."""
    async with open_cache() as cache:
        lease, seq, new, ctx = await misuse_setup(cache)
        bad = BAD_DEVICE_INDICES[kind](new, ctx)
        before = snapshot(cache)
        with pytest.raises(ValueError, match="device_indices"):
            await cache.insert(lease, seq, torch.cat([lease.device_indices, bad]))
        assert snapshot(cache) == before
        assert lease.active
        cache.sanity_check(held_device=[new])
        await cache.insert(lease, seq, torch.cat([lease.device_indices, new]))
        await cache.wait_idle()
        cache.sanity_check()
        assert_serves(cache, seq[: 7 * PAGE], cache.match(seq).device_indices)
        await check_workload_after(cache, [seq, tokens(100, 4 * PAGE), tokens(500, 4 * PAGE)])


async def test_insert_refuses_a_prefix_other_than_the_leases_own() -> None:
    """The first `cached_len` indices must be the lease's prefix: the caller's own pages in their place
    (which the tree would never take) are refused, and so are another lease's prefix pages."""
    async with open_cache() as cache:
        lease, seq, new, ctx = await misuse_setup(cache)
        spare = await cache.alloc_device(4 * PAGE)
        assert spare is not None
        for prefix in (spare, torch.cat([lease.device_indices[:-PAGE], ctx["other_prefix"]])):
            before = snapshot(cache)
            with pytest.raises(
                ValueError, match="device_indices: the first 16 must be the lease's own prefix"
            ):
                await cache.insert(lease, seq, torch.cat([prefix, new]))
            assert snapshot(cache) == before
            assert lease.active
        cache.release(lease, torch.cat([new, spare]))
        assert not lease.active
        cache.sanity_check()
        await check_workload_after(cache, [tokens(100, 4 * PAGE)])


@pytest.mark.parametrize("kind", sorted(BAD_DEVICE_INDICES))
async def test_release_refuses_device_indices_the_caller_does_not_hold(kind: str) -> None:
    """`release(lease, device_indices)` frees only caller-held pages: anything else is refused naming
    `device_indices`, the lease stays active and nothing is freed; the real pages then free cleanly."""
    async with open_cache() as cache:
        lease, _seq, new, ctx = await misuse_setup(cache)
        bad = BAD_DEVICE_INDICES[kind](new, ctx)
        before = snapshot(cache)
        with pytest.raises(ValueError, match="device_indices"):
            cache.release(lease, bad)
        assert snapshot(cache) == before
        assert lease.active
        with pytest.raises(ValueError, match="device_indices"):
            cache.release(lease, lease.device_indices)  # the lease's prefix is the tree's, never the caller's
        assert snapshot(cache) == before
        free_before = cache.device_pool.statistics().free_pages
        cache.release(lease, new)
        assert not lease.active
        assert cache.device_pool.statistics().free_pages == free_before + 4
        cache.sanity_check()
        with pytest.raises(PoolError, match="device_indices"):
            cache.release(lease, new)  # freed now: a second release of them is refused
        cache.sanity_check()
        await check_workload_after(cache, [tokens(100, 4 * PAGE), tokens(500, 4 * PAGE)])


async def test_insert_refuses_the_repro_of_issue_9() -> None:
    """The reported repro: pages never allocated used to be accepted, and `alloc` then handed the tree's
    pages to another request."""
    async with open_cache() as cache:
        lease = await cache.acquire("a", tokens(0, 32))
        got = await cache.alloc_device(32)
        assert got is not None
        with pytest.raises(PoolError, match="device_indices: page"):
            await cache.insert(lease, tokens(0, 32), torch.arange(96, 128))
        cache.sanity_check(held_device=[got])
        cache.device_pool.write_tokens(got, page_payload(as_key_bytes(tokens(0, 32))))
        await cache.insert(lease, tokens(0, 32), got)
        taken = cache.device_pool.alloc(96)  # every other page: none of them is the tree's
        assert taken is not None
        assert not set(taken.tolist()) & set(got.tolist())
        cache.device_pool.free(taken)
        assert_serves(cache, tokens(0, 32), cache.match(tokens(0, 32)).device_indices)


async def test_sanity_check_finds_a_page_held_twice_or_lost() -> None:
    """The partition is checked by identity: a caller page declared under the wrong identity, a page
    tagged for no one, and a page the tree holds but the pool thinks free are each reported."""
    async with open_cache() as cache:
        await fill(cache, tokens(0, 4 * PAGE))
        got = await cache.alloc_device(PAGE)
        assert got is not None
        cache.sanity_check(held_device=[got])
        cache.sanity_check(held_device_tokens=PAGE)  # the count form still works
        with pytest.raises(AssertionError, match="held by more than one owner"):
            cache.sanity_check(held_device=[cache.match(tokens(0, 4 * PAGE)).device_indices[:PAGE]])
        with pytest.raises(AssertionError, match="tagged LEASE but found nowhere"):
            cache.sanity_check(held_device=[])
        with pytest.raises(AssertionError, match="the caller holds 4 indices, expected 0"):
            cache.sanity_check()
        node = tree_of(cache).node_info(cache.match(tokens(0, 4 * PAGE)).last_device_node)
        assert node.device_value is not None
        cache.device_pool.set_owner(node.device_value[:PAGE], Owner.RELEASE)
        with pytest.raises(AssertionError, match="tagged RELEASE but found TREE"):
            cache.sanity_check(held_device=[got])
        cache.device_pool.set_owner(node.device_value[:PAGE], Owner.TREE)
        cache.release(await cache.acquire("x", tokens(0, 1)), got)
        cache.sanity_check()


# ---------------------------------------------------------------------------- hit attribution


class FirstProbeGated(PassThroughBackend):
    """Holds the first `exists` call at a gate; counts page reads."""

    def __init__(self, inner: MemoryBackend) -> None:
        super().__init__(inner)
        self.gate = anyio.Event()
        self.probing = anyio.Event()
        self.page_reads = 0

    async def exists(self, keys: Sequence[str]) -> int:
        if not self.probing.is_set():
            self.probing.set()
            await self.gate.wait()
        return await self.inner.exists(keys)

    async def get(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[PageStatus]:
        self.page_reads += len(keys)
        return await self.inner.get(keys, buffers)


async def test_tokens_another_request_inserted_during_the_probe_are_not_storage_hits() -> None:
    """Request A probes storage (held at a gate) while request B serves the same 64 tokens onto the device.
    A's lease covers all 64, read from the device: they are device hits, not storage hits (they used to
    count as 64/64 storage tokens with zero storage reads)."""
    from hicache.keys import Namespace

    async with MemoryBackend(namespace_digest=Namespace().digest) as inner:
        backend = FirstProbeGated(inner)
        async with HiCache(make_config(), storage=backend) as cache:  # type: ignore[arg-type]
            seq = tokens(40, 64)
            got: list[Any] = []
            async with anyio.create_task_group() as tg:

                async def acquire_a() -> None:
                    got.append(await cache.acquire("a", seq))

                tg.start_soon(acquire_a)
                await backend.probing.wait()
                await insert_device_chain(cache, seq)  # B: its own probe passes, storage has nothing
                backend.gate.set()
            lease = got[0]
            assert lease.cached_len == 64
            assert lease.prefetch is None
            assert lease.hit_tokens_by_tier == {"device": 64, "host": 0, "storage": 0}
            assert backend.page_reads == 0
            assert_serves(cache, seq, lease.device_indices)
            cache.release(lease)
            await cache.wait_idle()
            cache.sanity_check()


async def test_storage_hits_are_the_tokens_this_requests_prefetch_loaded() -> None:
    """Storage holds 64 tokens. Request A's probe (held at a gate) sizes its prefetch at all 64; meanwhile
    request B acquires the first 32 (its own prefetch, loaded back to the device). A's prefetch then finds
    those 32 present and loads the other 32: A counts 32 device hits and 32 storage hits (it used to count
    64 storage hits)."""
    from controller_helpers import store_sequence

    from hicache.keys import Namespace

    async with MemoryBackend(namespace_digest=Namespace().digest) as inner:
        backend = FirstProbeGated(inner)
        cache = HiCache(make_config(prefetch_stop_policy="wait_complete"), storage=backend)  # type: ignore[arg-type]
        async with cache:
            seq = tokens(40, 64)
            await store_sequence(inner, cache, seq)
            got: list[Any] = []
            async with anyio.create_task_group() as tg:

                async def acquire_a() -> None:
                    got.append(await cache.acquire("a", seq))

                tg.start_soon(acquire_a)
                await backend.probing.wait()
                b = await cache.acquire("b", seq[:32])  # B: its own prefetch, loaded back to device
                assert b.hit_tokens_by_tier == {"device": 0, "host": 0, "storage": 32}
                cache.release(b)
                backend.gate.set()
            lease = got[0]
            assert lease.cached_len == 64
            assert lease.prefetch is not None
            assert lease.prefetch.status == "committed"
            assert lease.prefetch.loaded_tokens == 32
            assert lease.hit_tokens_by_tier == {"device": 32, "host": 0, "storage": 32}
            assert_serves(cache, seq, lease.device_indices)
            cache.release(lease)
            await cache.wait_idle()
            cache.sanity_check()


async def test_prefetch_refuses_transfers_the_caller_does_not_hold() -> None:
    """Caller transfers handed to `prefetch` must be pages the caller holds: the tree's host pages, a page
    given twice and a foreign index are refused naming `transfers`, nothing changes; the real ones travel
    with the prefetch and are released with it."""
    from controller_helpers import store_sequence

    from hicache.controller.pages.release import ComponentTransfer
    from hicache.keys import Namespace

    async with (
        MemoryBackend(namespace_digest=Namespace().digest) as backend,
        HiCache(make_config(), storage=backend) as cache,  # type: ignore[arg-type]
    ):
        await fill(cache, tokens(0, 4 * PAGE))
        tree_host = tree_of(cache).node_info(cache.match(tokens(0, 4 * PAGE)).last_device_node).host_value
        assert tree_host is not None
        seq = tokens(500, 8 * PAGE)
        await store_sequence(backend, cache, seq)
        pool = host_pool_of(cache)
        spare = pool.alloc(PAGE)
        assert spare is not None
        for bad in (
            [ComponentTransfer("x", pool, tree_host[:PAGE])],
            [ComponentTransfer("x", pool, spare), ComponentTransfer("y", pool, spare)],
            [ComponentTransfer("x", pool, run(10**6))],
        ):
            before = snapshot(cache)
            with pytest.raises(PoolError, match="transfers"):
                await cache.prefetch("r", seq, transfers=bad)
            assert snapshot(cache) == before
        prefetch = await cache.prefetch("r", seq, transfers=[ComponentTransfer("x", pool, spare)])
        assert prefetch is not None
        assert pool.allocator.owner_of(int(spare[0]) // PAGE) is Owner.PREFETCH
        outcome = await cache.commit_prefetch("r")
        assert outcome.status == "committed"
        await cache.wait_idle()
        assert pool.allocator.is_free(int(spare[0]) // PAGE)
        cache.sanity_check()
