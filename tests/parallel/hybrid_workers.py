"""Per-rank workloads of the hybrid (sliding window + Mamba state) tensor-parallel tests (module level:
spawned ranks import them).

Each rank runs a `HiCache` with two components over a shared file storage directory, its own namespace
and `tp_group` set. Every byte a rank writes is its content oracle: the full-attention KV is
`cache_workers.payload(tokens, rank)`, a window token holds (token, position, rank) and a state digests
its whole prefix and the rank, so a component value of another node, prefix or rank read here would
show. Faults (component copies that fail, component pages storage drops) hit one rank only.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import xxhash

from hicache import HiCache, Lease
from hicache.components import MambaState, SlidingWindow
from hicache.memory import KVLayout
from hicache.parallel import RankGroup
from storage_backends.file import FileBackend
from storage_backends.protocol import PageStatus
from tests.parallel.cache_workers import PAGE, FlakyBackend, agree_equal, draw_requests, payload, tp_config

WINDOW = 8
SWA_LAYOUT = KVLayout.flat(8, PAGE)
STATE_NBYTES = 16
_COMPONENT_SUFFIXES = (b"swa".hex(), b"mamba".hex())


def components(swa_pages: int = 12, state_slots: int = 6) -> tuple[SlidingWindow, MambaState]:
    """A 8-token window (pages of `PAGE` tokens, 8 bytes a token) and a 16-byte state, small pools."""
    return (
        SlidingWindow(WINDOW, SWA_LAYOUT, device_pages=swa_pages, host_pages=swa_pages),
        MambaState(STATE_NBYTES, device_slots=state_slots, host_slots=state_slots),
    )


def swa_payload(tokens: Sequence[int], start: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s window KV of `tokens`, the first at position `start`: one int64 per token."""
    values = [t * 1_000_000 + (start + i) * 10 + rank for i, t in enumerate(tokens)]
    raw = torch.tensor(values, dtype=torch.int64).view(torch.uint8)
    return raw.view(SWA_LAYOUT.tokens_shape(len(values))).clone()


def state_payload(prefix: Sequence[int], rank: int) -> torch.Tensor:
    """Rank `rank`'s state at the end of `prefix`: a digest of every token and the rank."""
    digest = xxhash.xxh3_128_digest(
        torch.tensor(list(prefix), dtype=torch.int64).numpy().tobytes(), seed=rank
    )
    return torch.frombuffer(bytearray(digest), dtype=torch.uint8).view(1, 1, 1, 1, STATE_NBYTES).clone()


def check_lease(cache: HiCache, lease: Lease, seq: Sequence[int], rank: int) -> None:
    """The lease's base KV, window and state are this rank's, of this prefix."""
    n = lease.cached_len
    if not n:
        assert not lease.component_indices
        return
    got = cache.device_pool.read_tokens(lease.device_indices[:n]).cpu()
    assert torch.equal(got, payload(seq[:n], rank)), f"{lease.request_id}: cached KV is not this rank's"
    assert set(lease.component_indices) == {"swa", "mamba"}, lease.component_indices
    swa = lease.component_indices["swa"]
    start = n - int(swa.numel())
    assert int(swa.numel()) >= min(WINDOW, n)
    assert torch.equal(
        cache.component_pool("swa").read_tokens(swa), swa_payload(seq[start:n], start, rank)
    ), f"{lease.request_id}: window of {n} tokens is not this rank's"
    state = cache.component_pool("mamba").read_tokens(lease.component_indices["mamba"])
    assert torch.equal(state, state_payload(seq[:n], rank)), f"{lease.request_id}: state is not this rank's"


class ComponentFlaky(FlakyBackend):
    """`FlakyBackend` whose faults hit component pages only: a read of one is reported missing with
    probability `miss_p`; a lookup of them finds one fewer with `short_p`."""

    async def exists(self, keys: Sequence[str]) -> int:
        n = await self.inner.exists(keys)
        if n and _is_component(keys[0]) and self.rng.random() < self.short_p:
            self.faults += 1
            return n - 1
        return n

    async def get(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[PageStatus]:
        statuses = await self.inner.get(keys, buffers)
        out = []
        for key, status in zip(keys, statuses, strict=True):
            if status is PageStatus.HIT and _is_component(key) and self.rng.random() < self.miss_p:
                self.faults += 1
                out.append(PageStatus.MISS)
            else:
                out.append(status)
        return out


def _is_component(key: str) -> bool:
    return key.endswith(_COMPONENT_SUFFIXES) and len(key) > 32


def break_component_copies(cache: HiCache, rng: random.Random, p: float) -> list[int]:
    """Make this rank's component copies (backups and load-backs) raise with probability `p`; returns a
    one-element list counting the failures."""
    copies = cache._mover._copies
    real = copies.copy
    pools = {id(cache._component_pools[c.name].on(t)) for c in cache.components for t in ("device", "host")}
    failed = [0]

    async def flaky(*args: Any, **kwargs: Any) -> None:
        if id(args[0]) in pools and rng.random() < p:
            failed[0] += 1
            raise RuntimeError("injected: component copy failed on this rank")
        await real(*args, **kwargs)

    copies.copy = flaky  # type: ignore[method-assign]
    return failed


async def agreed_acquire(cache: HiCache, group: RankGroup, request_id: str, seq: Sequence[int]) -> Lease:
    """`acquire`, again after a `tp_sync` while it failed on any rank (a component load-back copy that
    failed there: the others got the device part only), as a serving loop retries a failed request."""
    for attempt in range(20):  # a retry can fail again (the faults are random)
        lease: Lease | None = None
        error = ""
        try:
            lease = await cache.acquire(f"{request_id}.{attempt}", seq)
        except RuntimeError as exc:
            error = str(exc)
        if error and "injected" not in error:
            raise AssertionError(f"{request_id}: acquire raised {error}")
        # The rank that raised left its load's agreement behind the others (still stepping in acquire):
        # a scheduling step's end brings every rank to the same step before the test's own collective.
        await cache.tp_sync()
        failed = int(group.gather(torch.tensor([int(lease is None)])).max())
        if not failed:
            assert lease is not None
            return lease
        if lease is not None:
            cache.release(lease)
    raise AssertionError(f"{request_id}: acquire failed 20 times")


async def serve_hybrid(
    cache: HiCache,
    group: RankGroup,
    request_id: str,
    seq: Sequence[int],
    check: Callable[[torch.Tensor | None, dict[str, torch.Tensor]], None],
) -> dict[str, Any]:
    """Serve the page-aligned `seq` as a hybrid model: acquire (checked against the oracle), allocate
    the new pages, the window's new part and the end state (one agreed allocation: `alloc_components_async`),
    write them, insert. `check` runs after every cache call with what the caller holds."""
    rank = group.tp_rank
    assert len(seq) % PAGE == 0
    lease = await agreed_acquire(cache, group, request_id, seq)
    check(None, {})
    check_lease(cache, lease, seq, rank)
    cached, n = lease.cached_len, len(seq)
    new: torch.Tensor | None = None
    owned: dict[str, torch.Tensor] = {}
    try:
        new = await cache.alloc_device(n - cached)
        check(new, {})
        if new is not None and n > cached:
            cache.device_pool.write_tokens(new, payload(seq[cached:], rank))
            start = max(n - WINDOW, cached)
            got = await cache.alloc_components_async({"swa": n - start, "mamba": 1})
            owned = {name: slots for name, slots in got.items() if slots is not None}
            if "swa" in owned:
                cache.component_pool("swa").write_tokens(owned["swa"], swa_payload(seq[start:n], start, rank))
            if "mamba" in owned:
                cache.component_pool("mamba").write_tokens(owned["mamba"], state_payload(seq, rank))
            check(new, owned)
            indices = torch.cat([lease.device_indices[:cached], new])
            taken, new, owned = owned, None, {}
            await cache.insert(lease, seq, indices, taken or None)
            check(None, {})
    finally:
        cache.release(lease, new, owned or None)
    return {"cached": cached, "hits": dict(lease.hit_tokens_by_tier)}


def aligned_requests(seed: int, n: int) -> list[list[int]]:
    """The shared workload of `cache_workers.draw_requests`, each request cut to whole pages."""
    return [seq[: len(seq) // PAGE * PAGE] for seq in draw_requests(seed, n)]


async def hybrid_workload(
    group: RankGroup,
    root: str,
    seed: int,
    fault_rank: int,
    n: int,
    faults: dict[str, float],
    per_rank: dict[str, dict[str, int]] | None = None,
) -> dict[str, Any]:
    """`n` hybrid requests; on `fault_rank` component copies fail (`copy_p`) and storage drops component
    pages (`miss_p`, `short_p`). After every cache call the trees (component tiers included) must agree
    and every page of every pool must have one owner; every third request ends a scheduling step. The
    cached lengths must agree. `per_rank`: component pool sizes by rank (`swa_pages`, `state_slots`)."""
    rank = group.tp_rank
    sizes = (per_rank or {}).get(str(rank), {})
    checks = 0

    def check(held: torch.Tensor | None, owned: dict[str, torch.Tensor]) -> None:
        nonlocal checks
        cache.sanity_check(
            across_ranks=True,
            held_device=[] if held is None else [held],
            held_components={name: [owned[name]] if name in owned else [] for name in ("swa", "mamba")},
        )
        checks += 1

    here = rank == fault_rank
    rng = random.Random(seed * 31 + rank)
    async with hybrid_cache(group, root, faults if here else None, rng, **sizes) as (cache, backend):
        copy_failures = break_component_copies(cache, rng, faults.get("copy_p", 0.0)) if here else [0]
        hits = {"device": 0, "host": 0, "storage": 0}
        for i, seq in enumerate(aligned_requests(seed, n)):
            served = await serve_hybrid(cache, group, f"r{i}", seq, check)
            agree_equal(group, served["cached"], f"the cached length of r{i}")
            for tier, k in served["hits"].items():
                hits[tier] += k
            if i % 3 == 2:
                await cache.tp_sync()
                check(None, {})
        await cache.wait_idle()
        check(None, {})
        stats = cache.statistics()
    return {
        "hits": hits,
        "checks": checks,
        "copy_failures": copy_failures[0],
        "storage_faults": backend.faults,
        "component_slots": {
            name: (c.device_slots, c.host_slots) for name, c in sorted(stats.components.items())
        },
    }


@contextlib.asynccontextmanager
async def hybrid_cache(
    group: RankGroup,
    root: str,
    faults: dict[str, float] | None,
    rng: random.Random,
    *,
    swa_pages: int = 12,
    state_slots: int = 6,
    **overrides: Any,
) -> AsyncIterator[tuple[HiCache, ComponentFlaky]]:
    """This rank's hybrid cache over the shared directory `root`, its storage dropping component pages
    as `faults` says (None: healthy); closes both on exit."""
    options: dict[str, Any] = {"host_pages": 32, "components": components(swa_pages, state_slots)}
    options.update(overrides)
    config = tp_config(group, group.tp_rank, group.tp_size, **options)
    backend = ComponentFlaky(
        FileBackend(Path(root), namespace_digest=config.namespace.digest), rng, **(faults or {})
    )
    try:
        async with HiCache(config, storage=backend) as cache:
            yield cache, backend
    finally:
        await backend.aclose()


async def hybrid_dead_peer(group: RankGroup, root: str, victim: int) -> dict[str, Any]:
    """Both ranks serve one hybrid request; then `victim` exits, and the other's next agreed component
    allocation raises `RankFailed` within the group timeout; its cache is then still sane."""
    rank = group.tp_rank
    async with hybrid_cache(group, root, None, random.Random(0)) as (cache, _):
        refused = ""
        try:
            cache.alloc_component("swa", PAGE)  # evicting on this rank's own pool facts: refused
        except RuntimeError as exc:
            refused = str(exc)
        await serve_hybrid(cache, group, "a", list(range(100, 100 + 6 * PAGE)), lambda h, o: None)
        await cache.tp_sync()
        if rank == victim:
            os._exit(23)
        error = ""
        try:
            await cache.alloc_components_async({"swa": PAGE})
        except Exception as exc:
            error = type(exc).__name__
        cache.sanity_check()
    return {"error": error, "refused": refused}


HYBRID_SEQ = [300 + i for i in range(10 * PAGE)]


async def component_pages_missing_on_one_rank(
    group: RankGroup, root: str, faulty: int, faults: dict[str, float]
) -> dict[str, Any]:
    """HYBRID_SEQ reaches storage with its window and state (a first cache on every rank); a fresh
    cache then acquires it, and `faulty`'s storage lacks its component pages (`short_p=1`: the lookup
    finds one fewer, `miss_p=1`: every read of one misses). A component missing on any rank is missing
    on every rank: the same skip or drop and cached length everywhere, trees compared after the call."""
    rank = group.tp_rank
    async with hybrid_cache(group, root, None, random.Random(0)) as (cache, _):
        await serve_hybrid(cache, group, "w", HYBRID_SEQ, lambda h, o: None)
        await cache.wait_idle()
    here = faults if rank == faulty else None
    async with hybrid_cache(group, root, here, random.Random(1)) as (cache, backend):
        lease = await cache.acquire("r", HYBRID_SEQ)
        cache.sanity_check(across_ranks=True)
        check_lease(cache, lease, HYBRID_SEQ, rank)
        outcome = lease.prefetch
        result = {
            "cached": lease.cached_len,
            "skipped": None if lease.prefetch_skipped is None else lease.prefetch_skipped.value,
            "drop": None if outcome is None or outcome.drop_reason is None else outcome.drop_reason.value,
            "faults": backend.faults,
        }
        cache.release(lease)
        await cache.tp_sync()
        cache.sanity_check(across_ranks=True)
    return result


async def unequal_windows(group: RankGroup, root: str) -> str:
    """Rank 1's window is 12 tokens, rank 0's 8: the caches refuse to start, on every rank."""
    window = 12 if group.tp_rank == 1 else WINDOW
    comps = (SlidingWindow(window, SWA_LAYOUT, device_pages=8, host_pages=8),)
    try:
        async with hybrid_cache(group, root, None, random.Random(0), components=comps):
            return "started"
    except ValueError as exc:
        return str(exc)
