"""Per-rank workloads of the tensor-parallel layer-wise load-back tests (module level: spawned ranks
import them).

Each rank runs a layer-wise `HiCache` (4 layers) over its own slice; its "model" reads a lease's cached
prefix layer by layer in a worker thread, calling `wait_layer(i)` before layer i, as a forward pass does
(on every rank, the same layers in the same order). Copy faults are injected in the copying thread on
one rank only (`LayeredLoader.before_layer`). The trees are compared after every cache call.
"""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import anyio.to_thread
import torch
from cache_workers import PAGE, agree_equal, draw_requests, rank_cache, serve_workload

from hicache import HiCache, KVLayout, LoadBackFailed
from hicache.controller.results import Lease
from hicache.memory.layerwise import read_layer_tokens
from hicache.parallel import RankGroup
from tests.cache_internals import layered_loader_of

LAYERS = 4
LAYOUT4 = KVLayout(num_layers=LAYERS, num_kv_heads=1, head_dim=4, dtype=torch.float32, page_size=PAGE)
SEQ = [500 + i for i in range(10 * PAGE)]
OPTIONS: dict[str, Any] = {"layout": LAYOUT4, "layerwise_load_back": True, "host_pages": 48}


def payload4(tokens: Sequence[int], rank: int) -> torch.Tensor:
    """Rank `rank`'s KV of `tokens` in `LAYOUT4`, exact in float32 (another rank's would show)."""
    ids = torch.tensor(list(tokens), dtype=torch.float32)
    n = ids.numel()
    layer = torch.arange(LAYERS, dtype=torch.float32).view(-1, 1, 1, 1, 1)
    plane = torch.arange(2, dtype=torch.float32).view(1, 2, 1, 1, 1)
    dim = torch.arange(LAYOUT4.head_dim, dtype=torch.float32).view(1, 1, 1, 1, -1)
    value = ids.view(1, 1, n, 1, 1) * 1000 + layer * 100 + plane * 10 + dim + rank * 3_000_000
    return value.expand(LAYERS, 2, n, 1, LAYOUT4.head_dim).contiguous()


class CopyFaults:
    """A `before_layer` hook: fails a layer's copy with probability `p` (or at `layer` once), and may
    hold a layer back until `release()` (a slow copy)."""

    def __init__(
        self,
        rng: random.Random,
        p: float = 0.0,
        *,
        layer: int | None = None,
        hold: bool = False,
        then_fail: bool = False,
    ):
        self.rng, self.p, self.layer, self.hold, self.then_fail = rng, p, layer, hold, then_fail
        self.reached = threading.Event()
        self._go = threading.Event()
        self.faults = 0

    def release(self) -> None:
        self._go.set()

    def __call__(self, layer: int) -> None:
        if self.layer == layer:
            self.reached.set()
            if self.hold:
                self._go.wait()
                if not self.then_fail:
                    return
            self.layer = None
            self.faults += 1
            raise RuntimeError(f"injected: copy of layer {layer} failed on this rank")
        if self.p and self.rng.random() < self.p:
            self.faults += 1
            raise RuntimeError(f"injected: copy of layer {layer} failed on this rank")


async def read_prefix(cache: HiCache, lease: Lease, seq: Sequence[int], rank: int) -> int:
    """The model's forward over the lease's cached prefix, in a worker thread: `wait_layer(i)`, then
    read layer i and check it against this rank's oracle. Returns the layer whose wait raised
    `LoadBackFailed`, or -1 when every layer was read."""
    cached = lease.cached_len
    want = payload4(seq[:cached], rank)

    def forward() -> int:
        for layer in range(LAYERS):
            try:
                lease.layers.wait_layer(layer)
            except LoadBackFailed:
                return layer
            got = read_layer_tokens(cache.device_pool, lease.device_indices[:cached], layer)
            assert torch.equal(got, want[layer]), f"layer {layer} of the cached prefix is not this rank's KV"
        return -1

    return await anyio.to_thread.run_sync(forward)


async def serve_layerwise(
    cache: HiCache, group: RankGroup, request_id: str, seq: Sequence[int], check: Callable[..., None]
) -> dict[str, int]:
    """Serve `seq` with a layer-wise forward; a failed layer (the same on every rank) makes the request
        release its lease and, after the scheduling step's end (`tp_sync`, where the failed load is dropped on
    every rank), acquire again, as a serving loop recomputes. Returns the cached length, the
        failed layer of the first try (-1: none) and the tries."""
    rank = group.tp_rank
    failed_first = -2
    for tries in range(1, 8):
        lease = await cache.acquire(f"{request_id}-{tries}", seq)
        check()
        new: torch.Tensor | None = None
        try:
            failed = await read_prefix(cache, lease, seq, rank) if lease.cached_len else -1
            agree_equal(group, failed, f"the failed layer of {request_id}")
            if failed_first == -2:
                failed_first = failed
            if failed >= 0:
                try:
                    await cache.insert(lease, seq, lease.device_indices)
                    raise AssertionError("insert took a lease whose prefix failed to load")
                except LoadBackFailed:
                    pass
                cache.release(lease)
                await cache.tp_sync()  # the scheduling step ends: the failed load resolves (dropped)
                continue
            cached = lease.cached_len
            n = len(seq)
            new = await cache.alloc_device(-(-n // PAGE) * PAGE - cached)
            check(new)
            agree_equal(group, int(new is not None), f"the allocation of {request_id}")
            if new is not None:
                cache.device_pool.write_tokens(new[: n - cached], payload4(seq[cached:], rank))
                indices = torch.cat([lease.device_indices[:cached], new])
                new = None
                await cache.insert(lease, seq, indices)
                check()
            return {"cached": cached, "failed_first": failed_first, "tries": tries}
        finally:
            cache.release(lease, new)
            check()
    raise AssertionError(f"{request_id}: every try failed to load its prefix")


def _checker(cache: HiCache) -> Callable[..., None]:
    def check(held: torch.Tensor | None = None) -> None:
        cache.sanity_check(across_ranks=True, held_device=[] if held is None else [held])

    return check


async def _push_to_host(cache: HiCache, group: RankGroup, check: Callable[..., None]) -> None:
    """Serve SEQ, then two other sequences that push it off the device (it stays on host)."""
    await serve_layerwise(cache, group, "a", SEQ, check)
    for i in range(2):
        other = [700 + 200 * i + j for j in range(10 * PAGE)]
        await serve_layerwise(cache, group, f"fill{i}", other, check)
        await cache.tp_sync()
        await cache.wait_idle()


async def copy_fails_on_one_rank(group: RankGroup, root: str, failing: int, layer: int) -> dict[str, Any]:
    """SEQ is on host only; acquiring it loads it back layer by layer, and `failing`'s copy fails at
    `layer`. Every rank's forward reads the layers below `layer` and raises `LoadBackFailed` at
    `layer`; at the next agreement step the load is dropped on every rank (the trees agree after every
    call), the lease's insert raises, and acquiring SEQ again loads it from host, correctly."""
    rank = group.tp_rank
    async with rank_cache(group, root, **OPTIONS) as (cache, _):
        check = _checker(cache)
        await _push_to_host(cache, group, check)
        faults = CopyFaults(random.Random(0), layer=layer if rank == failing else None)
        layered_loader_of(cache).before_layer = faults
        lease = await cache.acquire("b", SEQ)
        check()
        host_hit = lease.hit_tokens_by_tier["host"]
        failed = await read_prefix(cache, lease, SEQ, rank)
        agree_equal(group, failed, "the failed layer")
        with_lease = cache.statistics().tree
        await cache.tp_sync()  # the step that resolves the load: dropped on every rank
        check()
        try:
            await cache.insert(lease, SEQ, lease.device_indices)
            insert = "inserted"
        except LoadBackFailed:
            insert = "LoadBackFailed"
        cache.release(lease)
        check()
        after = cache.statistics().tree
        again = await serve_layerwise(cache, group, "c", SEQ, check)
        await cache.tp_sync()
        check()
    return {
        "host_hit": host_hit,
        "failed": failed,
        "faults": faults.faults,
        "insert": insert,
        "device_during": with_lease.device_tokens,
        "device_after": after.device_tokens,
        "again": again,
    }


async def slow_copy_on_one_rank(group: RankGroup, root: str, slow: int) -> dict[str, Any]:
    """`slow`'s copy is held back before layer 1 until its own forward waits for that layer: the other
    rank's forward waits in `wait_layer(1)` (no layer is ready until it landed on every rank), then
    every rank reads every layer; one agreement step then lands the load on every rank."""
    rank = group.tp_rank
    async with rank_cache(group, root, **OPTIONS) as (cache, _):
        check = _checker(cache)
        await _push_to_host(cache, group, check)
        faults = CopyFaults(random.Random(0), layer=1 if rank == slow else None, hold=True)
        layered_loader_of(cache).before_layer = faults
        lease = await cache.acquire("b", SEQ)
        check()
        async with anyio.create_task_group() as tg:
            if rank == slow:

                async def release_when_reached() -> None:
                    await anyio.to_thread.run_sync(faults.reached.wait)
                    faults.release()

                tg.start_soon(release_when_reached)
            failed = await read_prefix(cache, lease, SEQ, rank)
        await cache.tp_sync()
        check()
        await cache.insert(lease, SEQ, lease.device_indices)
        check()
        stats = cache.statistics().tree
    return {
        "failed": failed,
        "host_hit": lease.hit_tokens_by_tier["host"],
        "device_tokens": stats.device_tokens,
        "collectives": getattr(getattr(lease.layers, "inner", None), "collectives", -1),
    }


async def random_layerwise_workload(
    group: RankGroup, root: str, seed: int, fault_rank: int, n: int, fault_p: float
) -> dict[str, Any]:
    """`n` requests of the shared workload with layer-wise load-back on small pools (many host hits);
    on `fault_rank` each layer's copy fails with probability `fault_p`. Every failed layer is the same
    on every rank, the trees agree after every cache call, and every layer read is this rank's KV."""
    rank = group.tp_rank
    rng = random.Random(seed * 11 + rank)
    async with rank_cache(group, root, seed=seed, **OPTIONS) as (cache, _):
        check = _checker(cache)
        faults = CopyFaults(rng, fault_p if rank == fault_rank else 0.0)
        layered_loader_of(cache).before_layer = faults
        failed_loads = retried = 0
        cached_total = 0
        for served in await serve_workload(
            cache,
            group,
            draw_requests(seed, n),
            lambda name, seq: serve_layerwise(cache, group, name, seq, check),
            check,
        ):
            failed_loads += int(served["failed_first"] >= 0)
            retried += served["tries"] - 1
            cached_total += served["cached"]
        stats = cache.statistics()
    return {
        "faults": faults.faults,
        "failed_loads": failed_loads,
        "retried": retried,
        "cached": cached_total,
        "device_tokens": stats.tree.device_tokens,
    }


async def peer_dies_during_forward(group: RankGroup, root: str, victim: int) -> dict[str, Any]:
    """`victim` exits right after its acquire attached a layer-wise load; the other rank's `wait_layer`
    raises `RankFailed` within the group timeout (never hangs), its next agreement step too, and the
    failed agreement finishes the load: its pages leave the device tier and the cache stays sane."""
    rank = group.tp_rank
    async with rank_cache(group, root, **OPTIONS) as (cache, _):
        check = _checker(cache)
        await _push_to_host(cache, group, check)
        lease = await cache.acquire("b", SEQ)
        if rank == victim:
            os._exit(23)
        errors = []
        try:
            await read_prefix(cache, lease, SEQ, rank)
        except Exception as exc:
            errors.append(type(exc).__name__)
        try:
            await cache.tp_sync()
        except Exception as exc:
            errors.append(type(exc).__name__)
        loader = layered_loader_of(cache)
        while loader.in_flight:  # noqa: ASYNC110 - finished by the failed agreement once its copy settled
            await anyio.sleep(0.01)
        cache.release(lease)
        cache.sanity_check()
    return {"errors": errors}


async def kept_below_a_failed_load(group: RankGroup, root: str, failing: int) -> dict[str, Any]:
    """SEQ loads back layer by layer; `failing`'s copy is held before layer 1 while a request that
    computed LONGER itself inserts it (its own pages for SEQ's host-only nodes, and a child below) and
    another holds a lease on LONGER; then that copy fails. At the resolving step every rank fails the
    load, touching nothing in the tree: the holder read the inserted KV, and LONGER is a device hit on
    every rank, with this rank's KV. Trees compared after every call."""
    rank = group.tp_rank
    longer = [*SEQ, *range(3000, 3000 + PAGE)]
    async with rank_cache(group, root, **dict(OPTIONS, device_pages=24)) as (cache, _):
        check = _checker(cache)
        await _push_to_host(cache, group, check)
        early = await cache.acquire("early", [9000 + i for i in range(PAGE)])
        check()
        faults = CopyFaults(random.Random(0), layer=1 if rank == failing else None, hold=True, then_fail=True)
        layered_loader_of(cache).before_layer = faults
        loading = await cache.acquire("loading", SEQ)
        check()
        new = await cache.alloc_device(len(longer))
        check(new)
        assert new is not None
        cache.device_pool.write_tokens(new, payload4(longer, rank))
        await cache.insert(early, longer, new)
        check()
        holder = await cache.acquire("holder", longer)
        check()
        held = holder.hit_tokens_by_tier["device"]
        faults.release()
        failed = [await read_prefix(cache, lease, longer, rank) for lease in (loading, holder)]
        await cache.tp_sync()  # fails the load on every rank alike
        check()
        refused = 0
        for lease in (loading, holder):
            try:
                await cache.insert(lease, longer[: lease.cached_len], lease.device_indices)
            except LoadBackFailed:
                refused += 1
            cache.release(lease)
            check()
        await cache.tp_sync()
        check()
        match = cache.match(longer)
        got = cache.device_pool.read_tokens(match.device_indices).cpu()
        correct = bool(torch.equal(got, payload4(longer[: match.device_len], rank)))
    return {
        "held": held,
        "failed": failed,
        "refused": refused,
        "device_hit": match.device_len,
        "correct": correct,
    }
