"""Per-rank workloads for the tensor-parallel cache tests (module level: spawned ranks import them).

Every rank runs a `HiCache` over a shared file storage directory with its own namespace (rank and size in
it) and `tp_group` set; the workload is drawn from a seed shared by the ranks, the faults from one that
is not. The KV a rank writes is its content oracle: `payload(tokens, rank)` differs per rank, so a page of
another rank loaded here would show.
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import torch

from hicache import HiCache, HiCacheConfig
from hicache.errors import StorageError
from hicache.keys import Namespace
from hicache.memory import KVLayout
from hicache.parallel import RankGroup
from storage_backends.file import FileBackend
from storage_backends.protocol import PageStatus, StorageBackend
from tests.controller.controller_helpers import PassThroughBackend

PAGE = 4
LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32, page_size=PAGE)


def payload(tokens: Sequence[int], rank: int) -> torch.Tensor:
    """Rank `rank`'s KV of `tokens` (ids < 2,000), shaped for `KVPool.write_tokens`, exact in float32."""
    ids = torch.tensor(list(tokens), dtype=torch.float32)
    n = ids.numel()
    layer = torch.arange(LAYOUT.num_layers, dtype=torch.float32).view(-1, 1, 1, 1, 1)
    plane = torch.arange(2, dtype=torch.float32).view(1, 2, 1, 1, 1)
    dim = torch.arange(LAYOUT.head_dim, dtype=torch.float32).view(1, 1, 1, 1, -1)
    value = ids.view(1, 1, n, 1, 1) * 1000 + layer * 100 + plane * 10 + dim + rank * 3_000_000
    return value.expand(LAYOUT.num_layers, 2, n, 1, LAYOUT.head_dim).contiguous()


class FlakyBackend(PassThroughBackend):
    """Wraps a backend: on its rank only, drops pages from reads and lookups at random, or reads slowly.

    `miss_p`: each page of a `get` is reported missing with this probability (its buffer untouched);
    `error_p`: a whole `get` raises `StorageError`; `short_p`: `exists` reports one page fewer;
    `gate`: when set, each `get` signals `read_started` and waits for the gate (cancellation tests).
    """

    def __init__(self, inner: StorageBackend, rng: random.Random, **faults: float) -> None:
        super().__init__(inner)
        self.rng = rng
        self.miss_p = faults.get("miss_p", 0.0)
        self.error_p = faults.get("error_p", 0.0)
        self.short_p = faults.get("short_p", 0.0)
        self.slow_s = faults.get("slow_s", 0.0)
        self.gate: anyio.Event | None = None
        self.hidden = False
        """While set, `exists` finds nothing (storage not holding them yet, as far as this cache knows)."""
        self.read_started = anyio.Event()
        self.faults = 0

    async def exists(self, keys: Sequence[str]) -> int:
        if self.hidden:
            return 0
        n = await self.inner.exists(keys)
        if n and self.rng.random() < self.short_p:
            self.faults += 1
            return n - 1
        return n

    async def get(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[PageStatus]:
        self.read_started.set()
        if self.gate is not None:
            await self.gate.wait()
        if self.slow_s:
            await anyio.sleep(self.slow_s)  # a slow disk on this rank (a fault, not an ordering device)
        if self.rng.random() < self.error_p:
            self.faults += 1
            raise StorageError("injected: get failed on this rank")
        statuses = await self.inner.get(keys, buffers)
        out = []
        for status in statuses:
            if status is PageStatus.HIT and self.rng.random() < self.miss_p:
                self.faults += 1
                out.append(PageStatus.MISS)
            else:
                out.append(status)
        return out


def tp_config(group: RankGroup | None, rank: int, size: int, **overrides: Any) -> HiCacheConfig:
    options: dict[str, Any] = {
        "layout": LAYOUT,
        "device_pages": 16,
        "host_pages": 24,
        "prefetch_threshold": PAGE,
        "prefetch_stop_policy": "wait_complete",
        "storage_batch_pages": 2,
        "namespace": Namespace(model_id="tp-tests", tp_rank=rank, tp_size=size),
        "tp_group": group,
        "close_timeout_s": 2.0,
    }
    options.update(overrides)
    return HiCacheConfig(**options)


@contextlib.asynccontextmanager
async def rank_cache(
    group: RankGroup | None,
    root: str,
    *,
    rank: int | None = None,
    size: int | None = None,
    flaky: dict[str, float] | None = None,
    seed: int = 0,
    **overrides: Any,
) -> AsyncIterator[tuple[HiCache, FlakyBackend]]:
    """This rank's open cache over the shared directory `root` (storage wrapped in `FlakyBackend`);
    closes both on exit."""
    if group is not None:
        rank, size = group.tp_rank, group.tp_size
    config = tp_config(group, rank or 0, size or 1, **overrides)
    backend = FlakyBackend(
        FileBackend(Path(root), namespace_digest=config.namespace.digest),
        random.Random(seed),
        **(flaky or {}),
    )
    try:
        async with HiCache(config, storage=backend) as cache:
            yield cache, backend
    finally:
        await backend.aclose()


async def serve(
    cache: HiCache,
    rank: int,
    request_id: str,
    seq: Sequence[int],
    check: Callable[[torch.Tensor | None], None] | None = None,
) -> dict[str, Any]:
    """Serve `seq`: acquire, check the cached prefix against this rank's oracle, compute and insert the
    rest, release. Returns the cached length, the hits by tier and whether the prefetch stopped short of
    what storage matched with no page failing. `check` runs after every cache call (acquire,
    alloc_device, insert) with the device pages the caller holds: the ranks compare trees there, between
    quiescent points."""
    check = check or (lambda held: None)
    lease = await cache.acquire(request_id, seq)
    check(None)
    new: torch.Tensor | None = None
    try:
        cached = lease.cached_len
        if cached:
            got = cache.device_pool.read_tokens(lease.device_indices[:cached]).cpu()
            assert torch.equal(got, payload(seq[:cached], rank)), (
                f"{request_id}: cached KV is not this rank's"
            )
        n = len(seq)
        padded = -(-n // PAGE) * PAGE
        new = await cache.alloc_device(padded - cached)
        check(new)
        if new is not None:
            cache.device_pool.write_tokens(new[: n - cached], payload(seq[cached:], rank))
            indices = torch.cat([lease.device_indices[:cached], new])
            new = None
            await cache.insert(lease, seq, indices)
            check(None)
    finally:
        cache.release(lease, new)
    outcome = lease.prefetch
    # Short with no page failing: stopped by its timeout, or by the agreement (another rank's pages).
    short = (
        outcome is not None and not outcome.failed_pages and outcome.completed_tokens < outcome.matched_tokens
    )
    return {"cached": cached, "hits": dict(lease.hit_tokens_by_tier), "stopped_short": int(short)}


def draw_requests(seed: int, n: int) -> list[list[int]]:
    """A workload shared by the ranks: three system prompts, conversations that grow and come back."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 2000) for _ in range(8 * PAGE)] for _ in range(3)]
    seen: list[list[int]] = []
    out = []
    for _ in range(n):
        base = rng.choice(seen) if seen and rng.random() < 0.5 else list(rng.choice(prompts))
        seq = base + [rng.randrange(1, 2000) for _ in range(rng.randrange(1, 4) * PAGE + rng.randrange(PAGE))]
        seen.append(seq)
        out.append(seq)
    return out


def agree_equal(group: RankGroup, value: int, what: str) -> None:
    values = group.gather(torch.tensor([value], dtype=torch.int64)).view(-1).tolist()
    assert all(v == values[0] for v in values), f"the ranks disagree on {what}: {values}"


async def serve_workload(
    cache: HiCache,
    group: RankGroup,
    requests: Sequence[Sequence[int]],
    serve_one: Callable[[str, Sequence[int]], Awaitable[dict[str, Any]]],
    check: Callable[[], None],
) -> list[dict[str, Any]]:
    """Serve `requests` in turn with `serve_one(request_id, seq)`, the cached lengths agreed by the ranks;
    every third request ends a scheduling step (`tp_sync`) and `check` runs, as it does once the cache
    is idle at the end. Returns what `serve_one` returned, in order."""
    served = []
    for i, seq in enumerate(requests):
        one = await serve_one(f"r{i}", seq)
        agree_equal(group, one["cached"], f"the cached length of r{i}")
        served.append(one)
        if i % 3 == 2:
            await cache.tp_sync()
            check()
    await cache.wait_idle()
    check()
    return served


async def random_workload(
    group: RankGroup,
    root: str,
    seed: int,
    fault_rank: int,
    n: int,
    flaky: dict[str, float],
    overrides: dict[str, Any] | None = None,
    busy_rank: int | None = None,
) -> dict[str, Any]:
    """`n` requests from the shared workload; storage faults on `fault_rank` only, and on `busy_rank` an
    event loop kept busy by a task that blocks it for a millisecond at a time. After every cache call
    the trees must agree (fingerprints), with backups, write-through and prefetches in flight (nothing
    is waited for); every third request ends a scheduling step (`tp_sync`) and they are compared again.
    The cached lengths must agree too. `overrides` may hold `"per_rank"`: config overrides by rank (pools
    of different sizes)."""
    rank = group.tp_rank
    overrides = dict(overrides or {})
    per_rank = overrides.pop("per_rank", {})
    overrides.update(per_rank.get(str(rank), {}))
    checks = 0

    def check(held: torch.Tensor | None = None) -> None:
        nonlocal checks
        cache.sanity_check(across_ranks=True, held_device=[] if held is None else [held])
        checks += 1

    hits = {"device": 0, "host": 0, "storage": 0}
    stopped_short = 0
    flaky_here = flaky if rank == fault_rank else None
    async with (
        rank_cache(group, root, flaky=flaky_here, seed=seed * 7 + rank, **overrides) as (
            cache,
            backend,
        ),
        anyio.create_task_group() as tg,
    ):
        if rank == busy_rank:

            async def hog() -> None:
                while True:
                    time.sleep(0.001)  # noqa: ASYNC251 - blocks the loop on purpose: a busier scheduler
                    await anyio.lowlevel.checkpoint()

            tg.start_soon(hog)
        for served in await serve_workload(
            cache,
            group,
            draw_requests(seed, n),
            lambda name, seq: serve(cache, rank, name, seq, check),
            check,
        ):
            for tier, k in served["hits"].items():
                hits[tier] += k
            stopped_short += served["stopped_short"]
        stats = cache.statistics()
        tg.cancel_scope.cancel()
    return {
        "hits": hits,
        "faults": backend.faults,
        "stopped_short": stopped_short,
        "stats": repr(stats),
        "checks": checks,
        "host_tokens": stats.tree.host_tokens,
    }


SEQ = [500 + i for i in range(10 * PAGE)]


async def write_through(group: RankGroup, root: str) -> None:
    """Serve SEQ once and let it reach storage (a previous run on the same ranks)."""
    async with rank_cache(group, root) as (cache, _):
        await serve(cache, group.tp_rank, "w", SEQ)
        await cache.wait_idle()


async def cancel_on_one_rank(group: RankGroup, root: str, canceller: int) -> dict[str, Any]:
    """A fresh cache per rank prefetches SEQ from storage; `canceller`'s reads block and its acquire is
    cancelled once one has started, while the other ranks' prefetches complete and commit. The commit
    agrees 0 pages (a page counts only if every rank verified it): nothing is attached anywhere, the
    trees agree, and every page of the cancelled prefetch is back in the pool."""
    await write_through(group, root)
    rank = group.tp_rank
    async with rank_cache(group, root) as (cache, backend):
        cached = -1
        if rank == canceller:
            backend.gate = anyio.Event()  # never set: the reads hang until cancelled
            async with anyio.create_task_group() as tg:

                async def acquire() -> None:
                    await cache.acquire("r", SEQ)

                tg.start_soon(acquire)
                await backend.read_started.wait()
                tg.cancel_scope.cancel()
        else:
            lease = await cache.acquire("r", SEQ)
            cached = lease.cached_len
            cache.release(lease)
        await cache.tp_sync()
        await cache.wait_idle()
        cache.sanity_check(across_ranks=True)
        stats = cache.statistics()
    return {
        "cached": cached,
        "host_used": stats.host_pool.used_pages,
        "tree_nodes": stats.tree.num_nodes,
    }


async def killed_mid_prefetch(group: RankGroup, root: str, victim: int) -> dict[str, Any]:
    """`victim` dies (exits) as its first prefetch read starts; the others raise `RankFailed` within the
    group timeout from `acquire`, and their caches are sane with no prefetch page left held."""
    await write_through(group, root)
    rank = group.tp_rank
    async with rank_cache(group, root) as (cache, backend):
        if rank == victim:
            backend.gate = anyio.Event()
            async with anyio.create_task_group() as tg:

                async def acquire() -> None:
                    await cache.acquire("r", SEQ)

                tg.start_soon(acquire)
                await backend.read_started.wait()
                os._exit(23)
        error = ""
        try:
            await cache.acquire("r", SEQ)
        except Exception as exc:
            error = type(exc).__name__
        cache.sanity_check()  # local: every page free or owned, no prefetch left holding pages
        stats = cache.statistics()
    return {
        "error": error,
        "in_flight": stats.prefetches_in_flight + stats.detached_prefetches,
        "prefetch_tokens": stats.prefetch_tokens_in_flight,
    }


async def unequal_pages(group: RankGroup, root: str) -> str:
    """Rank 1's pages hold 8 tokens, rank 0's 4: the caches refuse to start, on every rank."""
    page = 8 if group.tp_rank == 1 else PAGE
    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32, page_size=page)
    try:
        async with rank_cache(group, root, layout=layout, prefetch_threshold=page):
            return "started"
    except ValueError as exc:
        return str(exc)


def _patch_backup_copy(cache: HiCache, replacement: Callable[..., Any]) -> Callable[..., Any]:
    """Route the cache's device-to-host copies (backups) through `replacement(real, *args)`; returns the
    real copy. The fault injection point of the backup tests."""
    copies = cache._mover._copies
    real = copies.copy

    async def patched(*args: Any, **kwargs: Any) -> None:
        if args[0] is cache.device_pool:  # device -> host: a backup
            await replacement(real, *args, **kwargs)
        else:
            await real(*args, **kwargs)

    copies.copy = patched  # type: ignore[method-assign]
    return real


async def backup_fails_on_one_rank(group: RankGroup, root: str, failing: int) -> dict[str, Any]:
    """`failing`'s first backup copy raises. A node is backed up only when every rank's copy finished:
    after the step that agrees it, SEQ is backed up nowhere and every rank's host pages are back in
    its pool; the trees agree after every call. A second sequence then backs up on every rank."""
    rank = group.tp_rank
    async with rank_cache(group, root) as (cache, _):
        failed: list[int] = []

        async def copy(real: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
            if rank == failing and not failed:
                failed.append(1)
                raise RuntimeError("injected: device-to-host copy failed")
            await real(*args, **kwargs)

        _patch_backup_copy(cache, copy)
        await serve(
            cache,
            rank,
            "a",
            SEQ,
            lambda held: cache.sanity_check(across_ranks=True, held_device=[] if held is None else [held]),
        )
        await cache.tp_sync()
        cache.sanity_check(across_ranks=True)
        first = cache.statistics()
        await serve(cache, rank, "b", [900 + i for i in range(6 * PAGE)])
        await cache.tp_sync()
        cache.sanity_check(across_ranks=True)
        second = cache.statistics()
    return {
        "host_tokens": first.tree.host_tokens,
        "host_used": first.host_pool.used_pages,
        "pending": first.tree.pending_backup_tokens,
        "then_host_tokens": second.tree.host_tokens,
        "then_host_used": second.host_pool.used_pages,
    }


async def backup_lands_on_one_rank_first(group: RankGroup, root: str, slow: int) -> dict[str, Any]:
    """`slow`'s backup copy waits on a gate while the other rank's lands. Until the step that agrees the
    backup, the node is pending (not backed up) on every rank, and the trees agree (fingerprints);
    once every copy landed, one `tp_sync` backs it up everywhere."""
    rank = group.tp_rank
    async with rank_cache(group, root) as (cache, _):
        gate = anyio.Event()

        async def copy(real: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
            if rank == slow:
                await gate.wait()
            await real(*args, **kwargs)

        _patch_backup_copy(cache, copy)
        await serve(cache, rank, "a", SEQ)
        if rank != slow:
            await cache._mover.backups.wait_idle()  # this rank's copy landed (not yet agreed)
        cache.sanity_check(across_ranks=True)  # rank 0's copy landed, rank 1's did not: both pending
        during = cache.statistics().tree
        gate.set()
        await cache.tp_sync()
        cache.sanity_check(across_ranks=True)
        after = cache.statistics().tree
    return {
        "pending": during.pending_backup_tokens,
        "host_during": during.host_tokens,
        "host_after": after.host_tokens,
        "pending_after": after.pending_backup_tokens,
    }


async def load_back_fails_on_one_rank(group: RankGroup, root: str, failing: int) -> dict[str, Any]:
    """SEQ is served, then pushed off the device to host by two other sequences; serving it again loads it
    back, and `failing`'s host-to-device copy raises. The load-back counts only if every rank's copy
    succeeded: the other rank frees its copy and returns the device part only, and the trees agree."""
    rank = group.tp_rank
    async with rank_cache(group, root, host_pages=48) as (cache, _):
        await serve(cache, rank, "a", SEQ)
        for i, other in enumerate(([700 + j for j in range(10 * PAGE)], [900 + j for j in range(10 * PAGE)])):
            await serve(cache, rank, f"fill{i}", other)
            await cache.tp_sync()
            await cache.wait_idle()
        if rank == failing:
            copies = cache._mover._copies  # the test's fault injection point: the copy of a load-back
            real = copies.copy

            async def broken(*args: Any, **kwargs: Any) -> None:
                copies.copy = real  # type: ignore[method-assign]
                raise RuntimeError("injected: host-to-device copy failed")

            copies.copy = broken  # type: ignore[method-assign]
        outcome: dict[str, Any] = {}
        try:
            lease = await cache.acquire("b", SEQ)
            outcome = {"cached": lease.cached_len, "host_hit": lease.hit_tokens_by_tier["host"]}
            cache.release(lease)
        except RuntimeError as exc:
            outcome = {"error": str(exc)}
        await cache.tp_sync()
        await cache.wait_idle()
        cache.sanity_check(across_ranks=True)
        lease = await cache.acquire("c", SEQ)  # the copy works again: now every rank loads it back
        outcome["then_host_hit"] = lease.hit_tokens_by_tier["host"]
        cache.release(lease)
        await cache.tp_sync()
        cache.sanity_check(across_ranks=True)
    return outcome


async def cross_rank_check_off_the_loop(group: RankGroup, root: str) -> dict[str, Any]:
    """Rank 0 starts `sanity_check_async(across_ranks=True)`; rank 1 makes its own call only once rank 0
    showed (a flag file) that its event loop ran another task meanwhile. A check that blocked rank 0's
    loop in the collective would never write the flag: rank 1 would never call and rank 0's collective
    would time out (`RankFailed`). Then rank 1's tree differs by one lock: both ranks' async checks
    raise `TreeDivergence` naming it."""
    rank = group.tp_rank
    flag = Path(root) / "rank0-loop-ran"
    async with rank_cache(group, root) as (cache, _):
        await serve(cache, rank, "a", SEQ)
        await cache.tp_sync()
        if rank == 0:
            async with anyio.create_task_group() as tg:
                tg.start_soon(partial(cache.sanity_check_async, across_ranks=True))
                await anyio.wait_all_tasks_blocked()  # the check waits in the collective, off the loop
                flag.write_text("ran")
        else:
            while not flag.exists():  # noqa: ASYNC110 - another process's signal: nothing to await
                await anyio.sleep(0.01)
            await cache.sanity_check_async(across_ranks=True)
        node = cache.match(SEQ).last_device_node
        if rank == 1:
            cache._tree.lock_device(node)  # the divergence under test
        error = ""
        try:
            await cache.sanity_check_async(across_ranks=True)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        if rank == 1:
            cache._tree.unlock_device(node)
    return {"error": error}


async def refill_rescued_on_every_rank(group: RankGroup, root: str, failing: int | None) -> dict[str, Any]:
    """SEQ is in storage (an earlier run). A fresh cache under `write_through_selective` computes its
    first 16 tokens (on the device, not backed up), then acquires SEQ: the storage refill would hang
    below that un-backed prefix, so the commit backs the prefix up first (`backup_then_attach`), agreed
    across the ranks. When `failing`'s backup copy fails, the rescue fails on every rank and the refill
    is dropped on every rank. Trees are compared after every call."""
    await write_through(group, root)
    rank = group.tp_rank
    options = {"write_policy": "write_through_selective", "refill_under_unbacked": "backup_then_attach"}
    async with rank_cache(group, root, **options) as (cache, backend):

        def check(held: torch.Tensor | None = None) -> None:
            cache.sanity_check(across_ranks=True, held_device=[] if held is None else [held])

        backend.hidden = True  # the prefix is computed here, as if storage had only what follows it
        await serve(cache, rank, "prefix", SEQ[: 4 * PAGE], check)
        backend.hidden = False
        await cache.tp_sync()
        check()
        if rank == failing:

            async def copy(real: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
                raise RuntimeError("injected: device-to-host copy failed")

            _patch_backup_copy(cache, copy)
        lease = await cache.acquire("full", SEQ)
        check()
        outcome = lease.prefetch
        result = {
            "cached": lease.cached_len,
            "storage_hit": lease.hit_tokens_by_tier["storage"],
            "rescued": outcome is not None and outcome.rescued,
            "drop": None if outcome is None or outcome.drop_reason is None else outcome.drop_reason.value,
        }
        cache.release(lease)
        await cache.tp_sync()
        check()
    return result


class FailingLookups(PassThroughBackend):
    """Every `exists` raises `StorageError` (a storage lookup that fails on this rank)."""

    async def exists(self, keys: Sequence[str]) -> int:
        raise StorageError("injected: exists failed on this rank")


async def skip_reason_on_one_rank(group: RankGroup, root: str, failing: int, why: str) -> dict[str, Any]:
    """SEQ is in storage (an earlier run). A fresh cache acquires it; on `failing` only, the storage lookup
    fails (`why="error"`) or the capacity is too small for the hit (`why="capacity"`), while the other
    ranks would admit it. Every rank skips with the reason that rank had, not a blanket `storage_miss`."""
    await write_through(group, root)
    rank = group.tp_rank
    overrides: dict[str, Any] = {}
    if rank == failing and why == "capacity":
        overrides["prefetch_capacity_tokens"] = PAGE
    config = tp_config(group, rank, group.tp_size, **overrides)
    inner = FileBackend(Path(root), namespace_digest=config.namespace.digest)
    backend: StorageBackend = FailingLookups(inner) if rank == failing and why == "error" else inner
    try:
        async with HiCache(config, storage=backend) as cache:
            lease = await cache.acquire("r", SEQ)
            cache.sanity_check(across_ranks=True)
            skipped = None if lease.prefetch_skipped is None else lease.prefetch_skipped.value
            result = {"cached": lease.cached_len, "skipped": skipped}
            cache.release(lease)
            await cache.tp_sync()
            cache.sanity_check(across_ranks=True)
    finally:
        await inner.aclose()
    return result


async def pending_backup_split_on_every_rank(group: RankGroup, root: str, slow: int) -> dict[str, Any]:
    """`slow`'s backup copies wait on a gate, so the first request's backup stays pending on every rank
    (its decision unresolved) while the second request, sharing its first 4 pages, splits the pending
    node and begins its own leaf below the split-off upper part. Once the gate opens and the ranks
    agree, all of it is backed up on every rank (before: every chain below the split was aborted)."""
    rank = group.tp_rank
    first = [700 + i for i in range(6 * PAGE)]
    second = first[: 4 * PAGE] + [800 + i for i in range(2 * PAGE)]
    async with rank_cache(group, root) as (cache, _):
        gate = anyio.Event()

        async def copy(real: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
            if rank == slow:
                await gate.wait()
            await real(*args, **kwargs)

        _patch_backup_copy(cache, copy)
        await serve(cache, rank, "a", first)
        await serve(cache, rank, "b", second)  # splits the pending node
        cache.sanity_check(across_ranks=True)
        during = cache.statistics().tree
        gate.set()
        await cache.tp_sync()
        cache.sanity_check(across_ranks=True)
        after = cache.statistics().tree
        backed = [
            int(cache.match(seq).last_host_node == cache.match(seq).last_device_node)
            for seq in (first, second)
        ]
        skipped = int(cache.metrics.backup_skipped.value())
    return {
        "pending": during.pending_backup_tokens,
        "host_after": after.host_tokens,
        "pending_after": after.pending_backup_tokens,
        "backed": backed,
        "skipped": skipped,
    }


async def alloc_waits_for_pending_backups(group: RankGroup, root: str, slow: int) -> dict[str, Any]:
    """`slow`'s backup copy waits on a gate; every rank then asks for every device page, which only the
    pending (device-locked) node holds. Every rank's `alloc_device` lets the begun backup resolve
    (agreed) and evicts the node, alike on every rank, instead of returning None."""
    rank = group.tp_rank
    seq = [600 + i for i in range(6 * PAGE)]
    async with rank_cache(group, root) as (cache, _):
        gate = anyio.Event()

        async def copy(real: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
            if rank == slow:
                await gate.wait()
            await real(*args, **kwargs)

        _patch_backup_copy(cache, copy)
        await serve(cache, rank, "a", seq)
        pending = cache.statistics().tree.pending_backup_tokens
        pages = cache.config.device_pages * PAGE
        got: list[torch.Tensor | None] = []

        async def alloc_all() -> None:
            got.append(await cache.alloc_device(pages))

        async with anyio.create_task_group() as tg:
            tg.start_soon(alloc_all)
            await anyio.wait_all_tasks_blocked()
            gate.set()
        taken = got[0]
        cache.sanity_check(across_ranks=True, held_device=[] if taken is None else [taken])
        result = {
            "pending": pending,
            "taken": 0 if taken is None else int(taken.numel()),
            "host": cache.match(seq).host_len,
        }
        if taken is not None:
            cache.device_pool.free(taken)
    return result
