"""`HiCache`: the object a serving loop embeds. The tree decides, this class executes.

It owns the radix tree, the device and host pools, the storage backend, the release queue and the
background workers (an anyio task group): device->host backups, host->storage write-through, prefetch
streams. Every method that changes the tree does so synchronously between awaits, so the tree is always
consistent when another coroutine runs; every await that may touch a buffer is cancellation-safe: a
device <-> host copy is waited for even when the caller is cancelled (a copy is short and cannot be
abandoned), and a storage read is abandoned at once, its buffers quarantined until its thread returns.

Deadlines: every awaitable public method honours the caller's cancellation, from anyio cancel scopes and
asyncio timeouts alike, and returns within a few event-loop turns of it, plus at most the device <-> host
copy in flight (never a storage I/O: a stuck read or write is abandoned). `aclose()` returns within
`config.close_timeout_s`. Storage calls run under `storage_read_timeout_s` / `storage_write_timeout_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import warnings
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Self

import anyio
import numpy as np
import numpy.typing as npt
import torch

from hicache.components import Component, component_storage_key
from hicache.config import HiCacheConfig
from hicache.controller.breaker import BreakerStatistics, CircuitBreaker
from hicache.controller.guarded_storage import GuardedStorage
from hicache.controller.prefetch import Prefetch, PrefetchOutcome, PrefetchState
from hicache.controller.release import ComponentTransfer, ReleaseBatch, ReleaseQueue, ReleaseStatistics
from hicache.controller.storage_probe import probe_hit_pages
from hicache.controller.storage_writer import StorageWriter
from hicache.controller.work_queue import WorkQueue
from hicache.errors import CacheClosed, InvariantViolation, StorageCircuitOpen, UnknownRequest
from hicache.keys import TOKEN_BYTES, KeyLike, as_key_bytes, chained_page_hashes
from hicache.memory import (
    KVPool,
    Owner,
    PoolStatistics,
    check_token_indices,
    copy_pages_async,
    make_device_pool,
    make_host_pool,
)
from hicache.metrics import CacheMetrics, CollectorRegistry, default_cache_metrics, rank_labels
from hicache.tree import InsertResult, MatchResult, RadixTree, TreeNode, TreeStatistics
from storage_backends.protocol import StorageBackend
from storage_backends.registry import open_backend
from storage_backends.threads import stray_threads

__all__ = ["CacheStatistics", "HiCache", "Lease"]

logger = logging.getLogger("hicache.cache")

_STOP_GRACE_S = 1.0
"""How long `cancel_prefetch` waits for a stream to stop before resolving it detached. A stream stops
within a few event-loop turns (a cancelled read abandons its threads); this only bounds a backend that
does not honour cancellation."""

_QUARANTINE_POLL_S = 0.02
"""How often a closing cache checks whether the stray threads under its quarantined pages returned."""

_MAX_BATCH = 64
_BACKPRESSURE_WAIT_S = 0.005
"""The most one `insert` waits for a background queue above half its limit to drain below it."""
"""Most queued backups (or storage writes) one background job takes: one device->host copy (or one storage
`put`) then serves every request that queued work meanwhile, so a saturated loop still drains the queues."""


@dataclass
class Lease:
    """A request's hold on its cached prefix, from `acquire` until `insert` or `release`.

    The prefix's nodes are device-locked for the lease's lifetime, so its device pages stay valid.

    Attributes:
        request_id: the request.
        key: the request's tokens as int64 bytes.
        node: the deepest cached node (device-locked); the root when nothing was cached.
        device_indices: device pool indices of the cached prefix, one per token.
        cached_len: tokens of the prefix available on device.
        hit_tokens_by_tier: where the cached tokens came from: `device`, `host`, `storage`. A storage
            hit is a token this request's own prefetch loaded; tokens another request put in the tree
            meanwhile count by the tier this request found them on.
        prefetch: the outcome of the request's storage prefetch, if one ran.
        component_indices: per hybrid component, the device indices the prefix uses (the sliding
            window's KV, the Mamba state's slot); empty without components.
    """

    request_id: str
    key: bytes
    node: TreeNode
    device_indices: torch.Tensor
    cached_len: int
    hit_tokens_by_tier: dict[str, int]
    prefetch: PrefetchOutcome | None = None
    active: bool = field(default=True, repr=False)
    component_indices: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class CacheStatistics:
    """A snapshot of the whole cache."""

    tree: TreeStatistics
    device_pool: PoolStatistics
    host_pool: PoolStatistics
    release_queue: ReleaseStatistics
    prefetches_in_flight: int
    prefetch_tokens_in_flight: int
    backups_queued: int
    storage_writes_queued: int
    closed: bool
    quarantined_pages: int = 0
    """Host pages held out of use because a stray storage thread may still write into them (released
    through the release queue once it returns)."""
    detached_prefetches: int = 0
    """Cancelled prefetches whose stream is still stopping; their pages go back when it has."""
    backups_queued_max: int = 0
    """The most backups ever queued at once (never above `config.backup_queue_limit`)."""
    storage_writes_queued_max: int = 0
    """The most storage writes ever queued at once (never above `config.storage_write_queue_limit`)."""
    storage_breaker: BreakerStatistics | None = None
    """The storage tier's circuit breaker (None without a storage tier)."""


class HiCache:
    """A hierarchical KV cache: radix tree over device and host pools, with an optional storage tier.

    Use it as an async context manager::

        async with HiCache(config) as cache:
            lease = await cache.acquire("req-1", tokens)
            ...  # compute KV for tokens[lease.cached_len:] into pages from `await cache.alloc_device(n)`
            await cache.insert(lease, tokens, indices)

    Args:
        config: the validated configuration.
        storage: a storage backend to use instead of opening `config.storage_url`; the caller keeps
            ownership (the cache does not close it).
        device_pool: a device pool to use instead of creating one (must match the layout).
        host_pool: a host pool to use instead of creating one (must match the layout).
        metrics: the prometheus_client registry to register the cache's metrics in (default: a private one).
        storage_breaker: the circuit breaker that guards the storage tier (default: one built from the
            config's `storage_breaker_*` fields); tests pass one with a fake clock.
    """

    def __init__(
        self,
        config: HiCacheConfig,
        *,
        storage: StorageBackend | None = None,
        device_pool: KVPool | None = None,
        host_pool: KVPool | None = None,
        metrics: CollectorRegistry | None = None,
        storage_breaker: CircuitBreaker | None = None,
    ) -> None:
        if not isinstance(config, HiCacheConfig):
            raise TypeError(f"config: expected a HiCacheConfig, got {type(config).__name__}")
        self.config = config
        self.page_size = config.page_size
        self.tree = RadixTree(
            config.page_size,
            write_policy=config.write_policy,
            eviction_policy=config.eviction_policy,
            write_through_threshold=config.write_through_threshold,
            namespace=config.namespace,
            components=config.components or None,
        )
        self.components: tuple[Component, ...] = self.tree.components
        for name, pool in (("device_pool", device_pool), ("host_pool", host_pool)):
            if pool is not None and pool.layout != config.layout:
                raise ValueError(f"{name}: layout {pool.layout} does not match config.layout {config.layout}")
        # The pools made here are the cache's to close (last, in `aclose`); pools passed in stay the
        # caller's. If making one fails, those already made are closed before the error propagates.
        self._owned_pools: list[KVPool] = []

        def own(pool: KVPool) -> KVPool:
            self._owned_pools.append(pool)
            return pool

        try:
            self.component_pools: dict[str, tuple[KVPool, KVPool]] = {}
            for comp in self.components:
                layout = comp.pool_layout(config.page_size)
                self.component_pools[comp.name] = (
                    own(make_device_pool(layout, comp.device_pages, name=f"{comp.name}-device")),
                    own(make_host_pool(layout, comp.host_pages, name=f"{comp.name}-host")),
                )
            self.device_pool = (
                device_pool
                if device_pool is not None
                else own(make_device_pool(config.layout, config.device_pages))
            )
            self.host_pool = (
                host_pool if host_pool is not None else own(make_host_pool(config.layout, config.host_pages))
            )
        except BaseException:
            for made in self._owned_pools:
                made.close()
            raise
        self.storage: StorageBackend | None = storage
        self._owns_storage = storage is None
        self.registry = metrics if metrics is not None else CollectorRegistry()
        self.metrics: CacheMetrics = default_cache_metrics(
            self.registry, const_labels=rank_labels(config.namespace)
        )
        self.release_queue = ReleaseQueue(
            self.host_pool, batch_tokens=config.release_batch_pages * self.page_size
        )
        self._prefetches: dict[str, Prefetch] = {}
        self._inflight_tokens = 0
        self.storage_breaker = (
            storage_breaker
            if storage_breaker is not None
            else CircuitBreaker(
                "storage",
                threshold=config.storage_breaker_threshold,
                backoff_initial_s=config.storage_breaker_backoff_s,
                backoff_max_s=config.storage_breaker_backoff_max_s,
            )
        )
        breaker_gauge = self.metrics.storage_breaker_state.labels(tier=self.storage_breaker.tier)
        breaker_gauge.set(self.storage_breaker.state)
        self.storage_breaker.listeners.append(lambda old, new: breaker_gauge.set(new))
        self._guarded: GuardedStorage | None = None
        """The storage backend behind the breaker: what prefetch and write-through call."""
        self._backups: WorkQueue[TreeNode] = WorkQueue(
            "backup", self._backup_batch, limit=config.backup_queue_limit, max_batch=_MAX_BATCH
        )
        self._storage_writes: WorkQueue[TreeNode] = WorkQueue(
            "storage write-through", self._store, limit=config.storage_write_queue_limit, max_batch=_MAX_BATCH
        )
        self._storage_writer: StorageWriter | None = None
        self._backup_lock = anyio.Lock()
        self._detached: set[Prefetch] = set()
        """Cancelled prefetches whose stream had not stopped yet: `_stream` releases them when it does."""
        self._task_group: anyio.abc.TaskGroup | None = None
        self._runner: asyncio.Task[None] | None = None
        self._stopping = anyio.Event()
        self._shut_down = anyio.Event()
        self._started = False
        self._closed = False
        self._copies = 0
        """Device <-> host copies in flight (`_copy`), the caller's load-backs included."""
        self._copies_idle: anyio.Event | None = None
        self._copy_limiter: anyio.CapacityLimiter | None = None
        """Threads that enqueue or run copies (set by `start`; None: anyio's default limiter)."""
        self._loading: dict[int, tuple[KVPool, torch.Tensor]] = {}
        """Device pages (base and component) of load-backs in flight, tagged `Owner.COPY`, by tensor id."""

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> Self:
        try:
            await self.start()
        except BaseException:
            # A storage URL or option refused by the backend: free the pools now, not in `__del__`.
            await self.aclose()
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Open the storage backend (if configured) and start the background workers.

        If starting fails (the backend cannot be opened, or the caller is cancelled), everything made so
        far (storage, pools) is closed before the error propagates, and the cache is closed.
        """
        if self._closed:
            raise CacheClosed("start: this HiCache was closed")
        if self._started:
            return
        try:
            if self.storage is None and self.config.storage_url is not None:
                self.storage = open_backend(
                    self.config.storage_url,
                    namespace_digest=self.config.namespace.digest,
                    **self._backend_options(self.config.storage_url),
                )
            if self.storage is not None:
                self._guarded = GuardedStorage(
                    self.storage, self.storage_breaker, self.metrics.storage_errors
                )
                self._storage_writer = StorageWriter(self, self._guarded)
                if not self.config.namespace.model_id:
                    logger.warning(
                        "HiCache has a storage tier but namespace.model_id is empty: every cache with the "
                        "same KV layout and an empty model_id shares pages with this one; pass "
                        "Namespace(model_id=<model name and revision, or a config hash>)"
                    )
            if self.device_pool.device.type == "cuda":
                # One thread enqueues every large CUDA copy plan: concurrent load-backs each launching
                # thousands of page copies from their own threads fight over the GIL (on an H200, 16
                # concurrent load-backs of 128 KiB pages ran at a quarter of one load-back's rate).
                self._copy_limiter = anyio.CapacityLimiter(1)
            # The workers live in a task of their own, not on the caller's cancel-scope stack: `aclose()`
            # may then be called from any scope (inside `move_on_after`, `asyncio.wait_for`) and return
            # within its bound while the rest of the shutdown finishes in that task.
            ready = anyio.Event()
            self._runner = asyncio.get_running_loop().create_task(
                self._run(ready), name=f"hicache-workers-{id(self):x}"
            )
            await ready.wait()
        except BaseException:
            await self._abort_start()
            raise
        self._started = True

    def _backend_options(self, url: str) -> dict[str, object]:
        """The backend's options: `storage_options`, plus the cache's timeouts for a client that has its
        own (S3: per-request read and write deadlines), unless the options set them."""
        options = dict(self.config.storage_options)
        if url.startswith("s3://"):
            options.setdefault("read_deadline_s", self.config.storage_read_timeout_s)
            options.setdefault("write_deadline_s", self.config.storage_write_timeout_s)
        return options

    async def _abort_start(self) -> None:
        """A failed `start()`: close what it opened and the pools; the cache stays closed."""
        self._closed = True
        if self._runner is not None:
            self._stopping.set()
            return  # the runner closes storage and pools on its way out
        with anyio.CancelScope(shield=True), anyio.move_on_after(self.config.close_timeout_s):
            await self._close_storage()
        self._close_pools()

    async def _run(self, ready: anyio.Event) -> None:
        """The workers' task: runs them until `aclose()`, then shuts down, however long stuck I/O takes."""
        try:
            async with anyio.create_task_group() as tg:
                self._task_group = tg
                tg.start_soon(self.release_queue.run)
                tg.start_soon(self._backups.run)
                tg.start_soon(self._storage_writes.run)
                ready.set()
                await self._stopping.wait()
                tg.cancel_scope.cancel()
            await self._shutdown()
        except BaseException:
            # Cancelled by the event loop's own shutdown: nothing left to run the rest; a pool still in
            # use by a stray thread is kept alive by that thread's buffer references.
            logger.warning("%r: shutdown interrupted", self)
            raise
        finally:
            self._task_group = None
            self._shut_down.set()

    async def _shutdown(self) -> None:
        """After the workers stopped: release what is left, close storage, wait for copies and stray reads
        (quarantined pages), then close the pools the cache made."""
        self._backups.close()
        self._storage_writes.close()
        for prefetch in list(self._detached):  # streams that never ran: nothing can write into them
            self._finish_detached(prefetch)
        self.release_queue.flush()
        await self._close_storage()
        await self._wait_for_copies()
        while self.release_queue.statistics().quarantined_calls:
            await anyio.sleep(_QUARANTINE_POLL_S)
            self.release_queue.flush()
        self.release_queue.flush()
        self._close_pools()

    async def _close_storage(self) -> None:
        if self.storage is not None and self._owns_storage:
            await self.storage.aclose()

    def _close_pools(self) -> None:
        for pool in self._owned_pools:
            pool.close()

    async def aclose(self) -> None:
        """Cancel prefetches, stop the workers, release everything, close storage and the pools made here.

        Idempotent, and bounded: returns within `config.close_timeout_s` (or the caller's own deadline,
        whichever is first). What is left then (a stuck storage thread, pages it may still write into) is
        logged and finishes in the background: buffers are released, and the pools the cache made are
        closed, only once no read or copy can write into them. Pools passed to the constructor stay open.
        """
        if not self._closed:
            self._closed = True
            for prefetch in list(self._prefetches.values()):
                self._cancel_now(prefetch)
            self._backups.close()
            self._storage_writes.close()
            self.release_queue.flush()
            if self._runner is None:  # never started: nothing runs, nothing reads
                self._close_pools()
                return
            self._stopping.set()
        if self._runner is None:
            return
        with anyio.move_on_after(self.config.close_timeout_s):
            await self._shut_down.wait()
        if not self._shut_down.is_set():
            stats = self.release_queue.statistics()
            logger.warning(
                "%r: aclose gave up waiting after %.3gs; left to finish in the background: "
                "%d quarantined host tokens, %d stray storage threads, %d copies in flight",
                self,
                self.config.close_timeout_s,
                stats.quarantined_tokens,
                stray_threads.count,
                self._copies,
            )

    async def _copy(
        self, src: KVPool, src_indices: torch.Tensor, dst: KVPool, dst_indices: torch.Tensor
    ) -> None:
        """`copy_pages_async`, counted (`aclose` closes no pool while a copy may still write into it,
        including load-backs running in the caller's own tasks) and never abandoned: a cancellation,
        anyio's or asyncio's own, is re-raised only once the copy has landed."""
        self._copies += 1
        try:
            await _wait_uncancelled(
                copy_pages_async(src, src_indices, dst, dst_indices, limiter=self._copy_limiter)
            )
        finally:
            self._copies -= 1
            if not self._copies and self._copies_idle is not None:
                self._copies_idle.set()

    async def _wait_for_copies(self) -> None:
        while self._copies:
            self._copies_idle = anyio.Event()  # set by the last copy to finish
            await self._copies_idle.wait()

    def __del__(self) -> None:
        # getattr: a constructor that raised never set the flags, and must not fail again here.
        if getattr(self, "_started", False) and not self._closed:
            warnings.warn(f"unclosed {self!r}", ResourceWarning, stacklevel=1)

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise CacheClosed(f"{what}: this HiCache was closed")
        if not self._started:
            raise CacheClosed(f"{what}: this HiCache was not started (use `async with HiCache(...)`)")

    # ------------------------------------------------------------------ observing

    def statistics(self) -> CacheStatistics:
        """A frozen snapshot of the tree, the pools, the release queue and the work in flight."""
        return CacheStatistics(
            tree=self.tree.statistics(),
            device_pool=self.device_pool.statistics(),
            host_pool=self.host_pool.statistics(),
            release_queue=self.release_queue.statistics(),
            prefetches_in_flight=len(self._prefetches),
            prefetch_tokens_in_flight=self._inflight_tokens,
            backups_queued=len(self._backups),
            storage_writes_queued=len(self._storage_writes),
            closed=self._closed,
            quarantined_pages=self.release_queue.statistics().quarantined_tokens // self.page_size,
            detached_prefetches=len(self._detached),
            backups_queued_max=self._backups.max_queued,
            storage_writes_queued_max=self._storage_writes.max_queued,
            storage_breaker=self.storage_breaker.statistics() if self.storage is not None else None,
        )

    def __repr__(self) -> str:
        t = self.tree.statistics()
        d, h = self.device_pool.statistics(), self.host_pool.statistics()
        state = "closed" if self._closed else "open" if self._started else "new"
        storage = type(self.storage).__name__ if self.storage is not None else None
        return (
            f"<HiCache {state} policy={self.config.write_policy.value} page_size={self.page_size} "
            f"nodes={t.num_nodes} device={d.used_pages}/{d.capacity_pages} pages "
            f"host={h.used_pages}/{h.capacity_pages} pages prefetches={len(self._prefetches)} "
            f"quarantined={self.release_queue.statistics().quarantined_tokens // self.page_size} pages "
            f"storage={storage}>"
        )

    def sanity_check(
        self,
        *,
        held_device_tokens: int = 0,
        held_component_slots: Mapping[str, int] | None = None,
        held_device: Sequence[torch.Tensor] | None = None,
        held_components: Mapping[str, Sequence[torch.Tensor]] | None = None,
    ) -> None:
        """Check the tree's invariants and that every page of every pool has exactly one owner.

        On the device and host pools and on every component pool, each page is in exactly one of: free,
        held by the tree, held by the caller (allocated, not inserted), the destination of a copy in
        flight (a load-back, a backup), buffers of a prefetch in flight, pending release. This is checked
        by identity of pages: every page's owner tag in its pool must match where the page is found (the
        tree's nodes, the load-backs and backups in flight, the prefetches, the release queue), no page is
        found in two places, and the pool's free count matches its free tags. Component indices the tree
        queued for freeing may carry any tag but must be allocated and found nowhere else.

        Args:
            held_device_tokens: device tokens the caller holds outside the tree (allocated, not inserted),
                checked as a count of caller-held pages; ignored when `held_device` is given.
            held_component_slots: per component, device slots the caller holds outside the tree (a
                count); ignored for components named in `held_components`.
            held_device: the device indices the caller holds, checked page by page.
            held_components: per component, the device indices the caller holds, checked page by page.

        Raises:
            InvariantViolation: listing every violation found.
        """
        violations: list[str] = []
        try:
            self.tree.sanity_check()
        except InvariantViolation as exc:
            violations.extend(exc.violations)
        device: list[torch.Tensor] = []
        host: list[torch.Tensor] = []
        pending: list[torch.Tensor] = []
        comp: dict[tuple[str, str], list[torch.Tensor]] = {}
        for node in self.tree.iter_nodes():
            for part, out in (
                (node.device_value, device),
                (node.host_value, host),
                (node.backup_pending, pending),
            ):
                if part is not None:
                    out.append(part)
            for name, data in (node.components or {}).items():
                for attr in ("device_value", "host_value", "backup_pending"):
                    value = getattr(data, attr)
                    if value is not None:
                        comp.setdefault((name, attr), []).append(value)
        loose: dict[tuple[str, str], list[torch.Tensor]] = {}
        for free in self.tree.queued_component_frees():
            loose.setdefault((free.component, free.tier), []).append(free.indices)

        def in_flight(pool: KVPool) -> dict[Owner, list[torch.Tensor]]:
            prefetch: list[torch.Tensor] = []
            for p in (*self._prefetches.values(), *self._detached):  # detached: still theirs
                if pool is self.host_pool:
                    prefetch.append(p.host_indices)
                prefetch.extend(t.indices for t in p.transfers if t.pool is pool)
            return {
                Owner.COPY: [indices for (p, indices) in self._loading.values() if p is pool],
                Owner.PREFETCH: prefetch,
                Owner.RELEASE: self.release_queue.pending_indices(pool),
            }

        claims = in_flight(self.device_pool)
        claims[Owner.TREE] = device
        if held_device is not None:
            claims[Owner.LEASE] = list(held_device)
        _check_owners(self.device_pool, "device pool", claims, [], held_device_tokens, violations)
        claims = in_flight(self.host_pool)
        claims[Owner.TREE] = host
        claims[Owner.COPY] = claims[Owner.COPY] + pending
        _check_owners(self.host_pool, "host pool", claims, [], 0, violations)
        for c in self.components:
            device_pool, host_pool = self.component_pools[c.name]
            claims = in_flight(device_pool)
            claims[Owner.TREE] = comp.get((c.name, "device_value"), [])
            if held_components is not None and c.name in held_components:
                claims[Owner.LEASE] = list(held_components[c.name])
            held = held_component_slots.get(c.name, 0) if held_component_slots else 0
            _check_owners(
                device_pool,
                f"{c.name} device pool",
                claims,
                loose.get((c.name, "device"), []),
                held,
                violations,
            )
            claims = in_flight(host_pool)
            claims[Owner.TREE] = comp.get((c.name, "host_value"), [])
            claims[Owner.COPY] = claims[Owner.COPY] + comp.get((c.name, "backup_pending"), [])
            _check_owners(
                host_pool, f"{c.name} host pool", claims, loose.get((c.name, "host"), []), 0, violations
            )
        if violations:
            raise InvariantViolation(violations)

    async def wait_idle(self) -> None:
        """Wait until no backup, storage write or release is queued or running.

        Returns at once when the cache is closed or closing (queued work is dropped then). Quarantined
        pages are not waited for: a stuck read may never return.
        """
        # A backup queues a storage write and both free pages: wait until all three are quiet at once.
        while not self._closed:
            await self._backups.wait_idle()
            await self._storage_writes.wait_idle()
            if self._closed:
                return
            await self.release_queue.drain()
            if self._backups.idle and self._storage_writes.idle:
                return

    # ------------------------------------------------------------------ matching and leases

    def match(self, tokens: KeyLike) -> MatchResult:
        """Match `tokens` against the tree: device hit, host hit beyond it, last device and host nodes."""
        return self.tree.match_prefix(tokens)

    async def acquire(self, request_id: str, tokens: KeyLike) -> Lease:
        """Match, prefetch storage hits and commit them, load host hits back, and lock the prefix.

        Args:
            request_id: a unique id for the request while it holds the lease.
            tokens: the request's token ids.

        Returns:
            A `Lease` whose `device_indices` hold the KV of `tokens[:cached_len]` on the device pool.
        """
        self._check_open("acquire")
        _check_request_id(request_id)
        key = as_key_bytes(tokens, name="tokens")
        first = self.tree.match_prefix(key)
        outcome: PrefetchOutcome | None = None
        anchor_end = 0
        if self.storage is not None:
            prefetch = await self.prefetch(request_id, key, first)
            if prefetch is not None:
                anchor_end = _depth(prefetch.anchor)  # where the prefetch's tokens start
                try:
                    outcome = await self.commit_prefetch(request_id)
                except BaseException:
                    # Cancelled (or failed) while waiting: stop the reads and give every page back.
                    if self._prefetches.get(request_id) is prefetch:
                        await self._stop_and_cancel(prefetch)
                    raise
            self._check_open("acquire")
        # Match again after any await: eviction may have changed the tree meanwhile.
        match = self.tree.match_prefix(key) if self.storage is not None else first
        # Storage hits are only the tokens this request's prefetch loaded: [start, end) below. Tokens
        # that other requests inserted or loaded meanwhile count by where this match finds them.
        loaded_end = loaded_start = 0
        if outcome is not None and outcome.status == PrefetchState.COMMITTED.value:
            loaded_end = anchor_end + outcome.completed_tokens
            loaded_start = loaded_end - outcome.loaded_tokens
        found_on_device = match.device_len
        match = await self.load_back(match)
        node = match.last_device_node
        self.tree.lock_device(node)
        self._free_component_garbage()
        cached = match.device_len
        storage_hit = max(0, min(loaded_end, cached) - loaded_start)
        on_device = min(found_on_device, cached)
        device_hit = on_device - max(0, min(loaded_end, on_device) - loaded_start)
        host_hit = cached - device_hit - storage_hit
        return Lease(
            request_id=request_id,
            key=key,
            node=node,
            device_indices=match.device_indices,
            cached_len=cached,
            hit_tokens_by_tier={
                "device": device_hit,
                "host": host_hit,
                "storage": storage_hit,
            },
            prefetch=outcome,
            component_indices=self.tree.component_window(node) if self.components else {},
        )

    def release(
        self,
        lease: Lease,
        device_indices: torch.Tensor | None = None,
        components: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """Give up a lease without inserting anything (the request was aborted). Idempotent.

        Args:
            lease: the request's lease from `acquire`.
            device_indices: device pages the request got from `alloc_device` and will not insert: they
                are freed. Not the lease's own prefix (the tree's pages).
            components: per component, device slots from `alloc_component` the request will not insert:
                they are freed.

        Raises:
            PoolError: naming `device_indices` or `components`, when an index is not one the caller holds
                (out of range, misaligned, repeated, free, held by the tree or in flight); nothing is
                freed and the lease stays as it was then.
        """
        claims = self._caller_claims(device_indices, components)
        if lease.active:
            lease.active = False
            self.tree.unlock_device(lease.node)
        for pool, indices in claims:
            pool.free(indices)

    def _caller_claims(
        self,
        device_indices: torch.Tensor | npt.NDArray[np.int64] | None,
        components: Mapping[str, torch.Tensor] | None,
    ) -> list[tuple[KVPool, torch.Tensor]]:
        """Check that `device_indices` and `components` are pages the caller holds (from `alloc_device`,
        `alloc_component`, not inserted, no page twice); return them with their pools. Changes nothing.
        """
        out: list[tuple[KVPool, torch.Tensor]] = []
        if device_indices is not None:
            self.device_pool.check_owned(device_indices, Owner.LEASE, name="device_indices")
            if isinstance(device_indices, torch.Tensor):  # `insert` checks a numpy view and frees nothing
                out.append((self.device_pool, device_indices))
        if components:
            if not isinstance(components, Mapping):
                raise TypeError(f"components: expected a mapping of name to indices, got {components!r:.80}")
            for name, indices in components.items():
                if name not in self.component_pools:
                    raise ValueError(f"components: unknown component {name!r}")
                pool = self.component_pools[name][0]
                pool.check_owned(indices, Owner.LEASE, name=f"components[{name!r}]")
                out.append((pool, indices))
        return out

    async def insert(
        self,
        lease: Lease,
        tokens: KeyLike,
        device_indices: torch.Tensor,
        components: Mapping[str, torch.Tensor] | None = None,
    ) -> InsertResult:
        """Insert a finished request's KV and release its lease.

        Args:
            lease: the request's lease from `acquire`.
            tokens: all tokens whose KV is in `device_indices` (the cached prefix included).
            device_indices: device indices for every token, padded to whole pages: the first
                `lease.cached_len` are the lease's own; pages the tree already holds and the trailing
                partial page are freed here.
            components: device indices of hybrid components from `alloc_component` (a sliding window's
                for a page-aligned suffix of the page-aligned tokens, a Mamba state's one slot taken
                after the last token); the cache owns them from here on and frees what the tree
                does not keep.

        Backpressure: while backups or storage writes are queued, `insert` first gives their workers a
        turn of the event loop, and while a queue is above half its limit it waits (at most 5 ms) for it
        to drain below; a serving loop that never suspends otherwise starves them. Cancelled during that
        wait, nothing was inserted and the lease is still held.

        Raises:
            TypeError: when `device_indices` is not an int64 tensor.
            ValueError, PoolError: naming `device_indices` when it has the wrong length, does not start
                with the lease's prefix, or holds a page the caller does not hold (out of range,
                negative, misaligned, repeated, never allocated, freed, in the tree, in flight);
                naming `components` likewise for component slots; naming `lease` or `tokens` for a
                released lease or tokens not extending its prefix. Nothing changes then: the pools,
                the tree and the lease stay as they were.
        """
        await self._give_workers_a_turn()
        self._check_open("insert")
        if not lease.active:
            raise ValueError(f"lease: the lease of request {lease.request_id!r} was already released")
        key = as_key_bytes(tokens, name="tokens")
        n = len(key) // TOKEN_BYTES
        page = self.page_size
        padded = -(-n // page) * page
        if not isinstance(device_indices, torch.Tensor) or device_indices.dtype != torch.int64:
            raise TypeError(f"device_indices: expected an int64 tensor, got {device_indices!r:.80}")
        if device_indices.dim() != 1 or device_indices.numel() != padded:
            raise ValueError(
                f"device_indices: expected {padded} indices ({n} tokens padded to pages of {page}), "
                f"got shape {tuple(device_indices.shape)}"
            )
        if (
            n < lease.cached_len
            or key[: lease.cached_len * TOKEN_BYTES] != lease.key[: lease.cached_len * TOKEN_BYTES]
        ):
            raise ValueError("tokens: must start with the lease's cached prefix")
        cached = lease.cached_len
        # One numpy view for the checks below: each costs a microsecond or two there.
        index_array = check_token_indices(device_indices, name="device_indices").numpy()
        # The rest must be pages the caller got from `alloc_device` (and components' slots from
        # `alloc_component`) and still holds: anything else would let two owners share a page.
        self._caller_claims(index_array[cached:], components)
        if not (index_array[:cached] == lease.device_indices.numpy()).all():
            raise ValueError(
                f"device_indices: the first {cached} must be the lease's own prefix (lease.device_indices)"
            )
        aligned = n // page * page
        if components:
            result = self.tree.insert(key, device_indices[:n], components)
        else:
            result = self.tree.insert(key[: aligned * TOKEN_BYTES], device_indices[:aligned])
        # The tree owns what it took; the rest is freed below (duplicates, the partial tail, components
        # it did not keep).
        self.device_pool.set_owner(index_array[cached:], Owner.TREE)
        for name, indices in (components or {}).items():
            self.component_pools[name][0].set_owner(indices, Owner.TREE)
        if result.prefix_len > lease.cached_len:
            self.device_pool.free(device_indices[lease.cached_len : result.prefix_len])
        if padded > aligned:
            self.device_pool.free(device_indices[aligned:])
        self.release(lease)
        self._free_component_garbage()
        self._schedule_backups(result.backups)
        return result

    # ------------------------------------------------------------------ components

    def _free_component_garbage(self) -> None:
        """Return every component index the tree let go of to its pool."""
        if not self.components:
            return
        for free in self.tree.take_component_frees():
            device_pool, host_pool = self.component_pools[free.component]
            (device_pool if free.tier == "device" else host_pool).free(free.indices)

    def _alloc_component_slots(
        self, name: str, tier: str, num_slots: int, *, owner: Owner
    ) -> torch.Tensor | None:
        """Allocate slots of a component's pool on `tier` for `owner`, evicting that component's values if
        needed."""
        device_pool, host_pool = self.component_pools[name]
        pool = device_pool if tier == "device" else host_pool
        indices = pool.alloc(num_slots, owner)
        if indices is not None:
            return indices
        if tier == "host":
            self.release_queue.flush()
        free = pool.statistics().free_pages * pool.page_size
        if free < num_slots:
            self.tree.evict_component(name, num_slots - free, tier)
            self._free_component_garbage()
        return pool.alloc(num_slots, owner)

    def alloc_component(self, name: str, num_slots: int) -> torch.Tensor | None:
        """Allocate device slots of component `name` (whole pages), evicting its unlocked values if needed.

        Returns None when not enough can be evicted. Pass the indices to `insert(components=...)`.

        Raises:
            ValueError: an unknown component or a count that is not a multiple of its page size.
        """
        self._check_open("alloc_component")
        if name not in self.component_pools:
            raise ValueError(f"name: unknown component {name!r}")
        page = self.component_pools[name][0].page_size
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 0 or num_slots % page:
            raise ValueError(f"num_slots: expected a non-negative multiple of {page}, got {num_slots!r}")
        return self._alloc_component_slots(name, "device", num_slots, owner=Owner.LEASE)

    # ------------------------------------------------------------------ device allocation and eviction

    async def alloc_device(self, num_tokens: int) -> torch.Tensor | None:
        """Allocate device pages for `num_tokens` (a multiple of the page size), evicting as needed.

        Succeeds whenever free device pages and the device pages of nodes without a device or host lock
        can make room, under every write policy and host size. Under write-back, evicted nodes are backed
        up to host first while their un-backed chains fit there, and dropped beyond that. Returns None
        when not enough can be evicted (running out is a value, not an error).
        """
        self._check_open("alloc_device")
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int):
            raise TypeError(f"num_tokens: expected an int, got {type(num_tokens).__name__}")
        if num_tokens < 0 or num_tokens % self.page_size:
            raise ValueError(
                f"num_tokens: expected a non-negative multiple of {self.page_size}, got {num_tokens}"
            )
        offer_host = True
        while True:
            indices = self.device_pool.alloc(num_tokens)
            if indices is not None:
                return indices
            need = num_tokens - self.device_pool.statistics().free_pages * self.page_size
            # The tree plans (demote, delete, back up or drop); this loop carries the plan out.
            room = self._host_room() if offer_host else 0
            result = self.tree.evict_device(need, host_free_tokens=room)
            self.device_pool.free(result.freed_device)
            self._free_component_garbage()
            if result.freed_host.numel():
                self.host_pool.free(result.freed_host)
            if result.dropped_tokens:
                self.metrics.evict_dropped_tokens.inc(result.dropped_tokens)
            # Root-first chains, each below the earlier ones: one batch begins them in order, so
            # `backup_chain` finds exactly the planned chains (an earlier chain's nodes are pending).
            backed_up = await self._backup_many(result.backup_first) if result.backups else 0
            if result.freed_device.numel() or backed_up:
                continue
            if not result.backups:
                return None  # nothing could be evicted, nor backed up to make it evictable
            # The planned backups found no host room after all (taken meanwhile by other work): plan
            # again without host room, so that un-backed leaves are dropped instead of waited on.
            offer_host = False

    def _host_room(self) -> int:
        """Host tokens a backup can have now: free pages plus what `evict_host` can really reclaim (host
        copies of host-only nodes without a host or device lock; never a device node's copy, a locked
        one, or an ancestor of a node on the device)."""
        self.release_queue.flush()
        free = self.host_pool.statistics().free_pages * self.page_size
        return free + self.tree.statistics().reclaimable_host_tokens

    def _alloc_host(self, num_tokens: int, *, owner: Owner, partial: bool = False) -> torch.Tensor | None:
        """Allocate host pages for `owner`, evicting host-only leaves if needed; `partial` takes what can
        be had."""
        indices = self.host_pool.alloc(num_tokens, owner)
        if indices is not None:
            return indices
        self.release_queue.flush()
        free = self.host_pool.statistics().free_pages * self.page_size
        if free < num_tokens:
            evicted = self.tree.evict_host(num_tokens - free)
            if evicted.freed_host.numel():
                self.host_pool.free(evicted.freed_host)
            self._free_component_garbage()
        indices = self.host_pool.alloc(num_tokens, owner)
        if indices is None and partial:
            free = self.host_pool.statistics().free_pages * self.page_size
            indices = self.host_pool.alloc(free, owner) if free > 0 else None
        return indices

    # ------------------------------------------------------------------ device <-> host

    async def load_back(self, match: MatchResult) -> MatchResult:
        """Copy the host-only part of a match back to device and return the fresh match.

        If device memory cannot be found the match is returned unchanged (a value, not an error).
        """
        self._check_open("load_back")
        if match.host_len == 0:
            return match
        key = match.key
        start, length = match.device_len, match.host_len
        last_host = match.host_nodes[-1]
        self.tree.lock_device(match.last_device_node)
        self.tree.lock_host(last_host)
        try:
            host_values = torch.cat(
                [node.host_value for node in match.host_nodes if node.host_value is not None]
            )
            device_indices = await self.alloc_device(length)
            if device_indices is None:
                # No room: the device part alone, cut back to where every component is valid.
                return self.tree.match_prefix(key[: start * TOKEN_BYTES]) if self.components else match
            self.device_pool.set_owner(device_indices, Owner.COPY)
            self._loading[id(device_indices)] = (self.device_pool, device_indices)
            loaded: dict[tuple[TreeNode, str], tuple[torch.Tensor, torch.Tensor]] = {}
            try:
                await self._copy(self.host_pool, host_values, self.device_pool, device_indices)
                if self.components:
                    loaded = await self._load_components(match.host_nodes)
            except BaseException:
                self.device_pool.free(device_indices)
                raise
            finally:
                self._loading.pop(id(device_indices), None)
                for _, device in loaded.values():
                    self._loading.pop(id(device), None)
            # The copies are the tree's now; `_attach_loaded` frees those no node takes.
            self.device_pool.set_owner(device_indices, Owner.TREE)
            for (_, name), (_, device) in loaded.items():
                self.component_pools[name][0].set_owner(device, Owner.TREE)
            self._attach_loaded(key, start, device_indices, loaded)
            self.metrics.load_back_tokens.inc(length)
        finally:
            self.tree.unlock_host(last_host)
            self.tree.unlock_device(match.last_device_node)
        return self.tree.match_prefix(key)

    async def _load_components(
        self, nodes: Sequence[TreeNode]
    ) -> dict[tuple[TreeNode, str], tuple[torch.Tensor, torch.Tensor]]:
        """Copy the host component values of `nodes` to fresh device slots: (node, name) -> (host, device).

        A component whose device slots cannot be had is not loaded (its nodes stay tombstones there).
        """
        loaded: dict[tuple[TreeNode, str], tuple[torch.Tensor, torch.Tensor]] = {}
        try:
            for node in nodes:
                for comp in self.components:
                    host = self.tree.component_value(node, comp.name, "host")
                    if host is None:
                        continue
                    device = self._alloc_component_slots(
                        comp.name, "device", int(host.numel()), owner=Owner.COPY
                    )
                    if device is None:
                        continue
                    loaded[(node, comp.name)] = (host, device)
                    device_pool, host_pool = self.component_pools[comp.name]
                    self._loading[id(device)] = (device_pool, device)
                    await self._copy(host_pool, host, device_pool, device)
        except BaseException:
            for (_, name), (_, device) in loaded.items():
                self._loading.pop(id(device), None)
                self.component_pools[name][0].free(device)
            raise
        return loaded

    def _attach_loaded(
        self,
        key: bytes,
        start: int,
        device_indices: torch.Tensor,
        components: Mapping[tuple[TreeNode, str], tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> None:
        """Attach freshly loaded device pages to the nodes covering tokens [start, start + n) now.

        Re-walks the tree so that splits or a concurrent load of the same nodes while the copy ran are
        handled: pages of nodes already on device again are freed as duplicates.
        """
        end = start + int(device_indices.numel())
        pending = dict(components or {})
        current = self.tree.match_prefix(key[: end * TOKEN_BYTES])
        offset = current.device_len
        duplicate_end = min(end, offset)
        if duplicate_end > start:
            self.device_pool.free(device_indices[: duplicate_end - start])
        for node in current.host_nodes:
            node_end = offset + node.num_tokens
            if node_end > end:
                break
            if offset >= start:
                comps: dict[str, torch.Tensor] = {}
                for comp in self.components:
                    entry = pending.pop((node, comp.name), None)
                    # The host value may have been split meanwhile: attach the copy only if it still fits.
                    if entry is not None and self.tree.component_value(node, comp.name, "host") is entry[0]:
                        comps[comp.name] = entry[1]
                    elif entry is not None:
                        self.component_pools[comp.name][0].free(entry[1])
                self.tree.attach_device(
                    node, device_indices[offset - start : node_end - start], comps or None
                )
            offset = node_end
        if offset < end:
            # A tail not attached: nodes loaded meanwhile by another request, or beyond where the re-match
            # now ends (a component's valid end moved; it may end before `start`, on the device part).
            self.device_pool.free(device_indices[max(offset, start) - start :])
        for (_, name), (_, copy) in pending.items():  # copies of nodes not attached here
            self.component_pools[name][0].free(copy)

    async def _give_workers_a_turn(self) -> None:
        """Backpressure on the serving loop: yield to the backup and storage-write workers when they have
        work, and wait (bounded) for a queue above half its limit."""
        if self._backups.idle and self._storage_writes.idle:
            return
        await anyio.lowlevel.checkpoint()
        for queue in (self._backups, self._storage_writes):
            watermark = (queue.limit or 0) // 2
            if queue.limit is not None and len(queue) > watermark:
                with anyio.move_on_after(_BACKPRESSURE_WAIT_S):
                    await queue.wait_below(watermark)

    def _schedule_backups(self, targets: Sequence[TreeNode]) -> None:
        shed = self._backups.put(targets)
        if shed:
            self.metrics.writes_shed.inc(len(shed), tier="host", reason="queue_full")

    async def _backup_batch(self, targets: list[TreeNode]) -> None:
        await self._backup_many(targets)

    async def _backup(self, target: TreeNode) -> bool:
        """Back `target` up to host with its un-backed ancestors, root first. True when committed."""
        return await self._backup_many([target]) > 0

    async def _backup_many(self, targets: Sequence[TreeNode]) -> int:
        """Back `targets` up to host, each with its un-backed ancestors, root first, in one device->host
        copy (one thread hop however many requests queued backups meanwhile). Returns how many targets
        were committed (those backed up already, pending or without host room are not)."""
        async with self._backup_lock:
            chains: list[tuple[TreeNode, list[TreeNode]]] = []
            nodes: list[TreeNode] = []
            host_parts: list[torch.Tensor] = []
            comp_copies: dict[tuple[TreeNode, str], tuple[torch.Tensor, torch.Tensor]] = {}
            try:
                for target in targets:
                    # Computed after the earlier chains began: a shared ancestor is pending by now and
                    # ends this chain, so every node is copied once and committed after its parent.
                    chain = self.tree.backup_chain(target)
                    if not chain:
                        continue
                    sizes = [node.num_tokens for node in chain]
                    host_indices = self._alloc_host(sum(sizes), owner=Owner.COPY)
                    if host_indices is None:
                        self.metrics.backup_skipped.inc()
                        continue
                    staged_comps = self._stage_component_backup(chain) if self.components else {}
                    comp_copies.update(staged_comps)
                    offset = 0
                    for node, size in zip(chain, sizes, strict=True):
                        staged = {name: host for (n, name), (_, host) in staged_comps.items() if n is node}
                        self.tree.begin_backup(node, host_indices[offset : offset + size], staged or None)
                        nodes.append(node)
                        offset += size
                    host_parts.append(host_indices)
                    chains.append((target, chain))
                if not chains:
                    return 0
                device_values = torch.cat(
                    [node.device_value for node in nodes if node.device_value is not None]
                )
                await self._copy(self.device_pool, device_values, self.host_pool, torch.cat(host_parts))
                for (_, name), (device, host) in comp_copies.items():
                    device_pool, host_pool = self.component_pools[name]
                    await self._copy(device_pool, device, host_pool, host)
            except BaseException:
                for node in reversed(nodes):
                    self.host_pool.free(self.tree.abort_backup(node))
                self._free_component_garbage()
                raise
            # Root first. A node split while copying is committed together with its split-off upper part.
            for node in nodes:
                self.tree.commit_backup(node)
            # The host copies now belong to the tree (before freeing what it let go of among them).
            for part in host_parts:
                self.host_pool.set_owner(part, Owner.TREE)
            for (_, name), (_, host) in comp_copies.items():
                self.component_pools[name][1].set_owner(host, Owner.TREE)
            self._free_component_garbage()
            self.metrics.backup_tokens.inc(sum(node.num_tokens for node in nodes))
        if self._storage_writer is not None and self.config.backup_to_storage:
            self._queue_storage_writes([target for target, _ in chains])
        return len(chains)

    def _queue_storage_writes(self, targets: list[TreeNode]) -> None:
        """Queue write-through of `targets`; shed (and count) them at once while storage is down."""
        if not self.storage_breaker.allows():
            self.metrics.writes_shed.inc(len(targets), tier="storage", reason="storage_unavailable")
            return
        shed = self._storage_writes.put(targets)
        if shed:
            self.metrics.writes_shed.inc(len(shed), tier="storage", reason="queue_full")

    def _stage_component_backup(
        self, chain: Sequence[TreeNode]
    ) -> dict[tuple[TreeNode, str], tuple[torch.Tensor, torch.Tensor]]:
        """Host slots for the component device values of `chain`: (node, name) -> (device, host).

        A component whose host slots cannot be had is not backed up (the node is a tombstone there).
        """
        out: dict[tuple[TreeNode, str], tuple[torch.Tensor, torch.Tensor]] = {}
        for node in chain:
            for comp in self.components:
                device = self.tree.component_value(node, comp.name, "device")
                if device is None:
                    continue
                host = self._alloc_component_slots(comp.name, "host", int(device.numel()), owner=Owner.COPY)
                if host is not None:
                    out[(node, comp.name)] = (device, host)
        return out

    # ------------------------------------------------------------------ host -> storage

    async def _store(self, targets: list[TreeNode]) -> None:
        if self._storage_writer is None:
            return
        if not self.storage_breaker.allows():
            self.metrics.writes_shed.inc(len(targets), tier="storage", reason="storage_unavailable")
            return
        try:
            await self._storage_writer.store_many(targets)
        except StorageCircuitOpen:
            self.metrics.writes_shed.inc(len(targets), tier="storage", reason="storage_unavailable")
        except OSError as exc:  # counted by the guard (`storage_errors`) and the writer; no traceback
            logger.warning("storage write-through of %d node(s) failed: %r", len(targets), exc)

    # ------------------------------------------------------------------ prefetch

    async def prefetch(
        self,
        request_id: str,
        tokens: KeyLike,
        match: MatchResult | None = None,
        *,
        transfers: Sequence[ComponentTransfer] = (),
    ) -> Prefetch | None:
        """Start streaming the storage hit beyond `match` into host pages; None when skipped.

        Skipped (and counted) when there is no storage, the page-aligned remainder beyond the match is
        below `prefetch_threshold`, the tokens in flight would exceed the capacity, storage holds too few
        of the pages, or the host pool cannot take enough of them. The anchor (the match's last host
        node) stays host-locked until the prefetch is committed or cancelled.

        Args:
            request_id: unique among prefetches in flight.
            tokens: the request's tokens.
            match: the request's match (computed here when omitted).
            transfers: component buffers staged with this prefetch; they are released with it. Their
                indices into a `KVPool` must be pages the caller holds (allocated, not handed over).

        Raises:
            ValueError: naming `request_id` when it is empty or already has a prefetch in flight.
            PoolError: naming `transfers` when one holds an index the caller does not hold.
        """
        self._check_open("prefetch")
        _check_request_id(request_id)
        if request_id in self._prefetches:
            raise ValueError(f"request_id: a prefetch for {request_id!r} is already in flight")
        self._check_transfers(transfers)
        key = as_key_bytes(tokens, name="tokens")
        page = self.page_size
        aligned = len(key) // TOKEN_BYTES // page * page
        key = key[: aligned * TOKEN_BYTES]
        if match is None:
            match = self.tree.match_prefix(key)
        self.metrics.prefetch_requested.inc()
        matched = match.device_len + match.host_len
        remainder = aligned - matched
        storage = self._guarded
        if storage is None:
            self._skip("no_storage")
            return None
        if remainder <= 0 or remainder < self.config.prefetch_threshold:
            self._skip("below_threshold")
            return None
        if self._inflight_tokens + remainder > self.config.capacity_tokens:
            self._skip("capacity")
            return None
        if not self.storage_breaker.allows():  # storage is down and no probe is due: no I/O at all
            self._skip("storage_unavailable")
            return None
        anchor = match.last_host_node
        anchor_end = _depth(anchor)
        self.tree.lock_host(anchor)
        try:
            hashes = chained_page_hashes(
                key[anchor_end * TOKEN_BYTES :], page, self.config.namespace, anchor.last_hash
            )
            page_keys = [h.hex() for h in hashes]
            hit_pages: int | None = None
            skip = "storage_error"
            try:
                # A hung lookup must not hang the request: it gets the stream's budget, at most a read's.
                budget = min(self.config.prefetch_timeout(remainder), self.config.storage_read_timeout_s)
                with anyio.move_on_after(budget) as lookup:
                    hit_pages = await probe_hit_pages(storage, page_keys)
                if lookup.cancelled_caught:
                    storage.record_timeout("exists")
            except StorageCircuitOpen:  # another request holds the probe, or the breaker just opened
                skip = "storage_unavailable"
            except Exception as exc:  # a storage failure makes the prefetch empty, never the caller's error
                logger.warning("prefetch %s: storage lookup failed: %r", request_id, exc)
            if hit_pages is None:
                if skip == "storage_error":
                    reason = "timeout" if lookup.cancelled_caught else "exists"
                    self.metrics.storage_page_failures.labels(reason=reason).inc()
                self.tree.unlock_host(anchor)
                self._skip(skip)
                return None
            self._check_open("prefetch")
            self._forget_stored(page_keys[hit_pages:])
            hit = hit_pages * page
            if anchor_end + hit - matched < self.config.prefetch_threshold:
                self.tree.unlock_host(anchor)
                self._skip("storage_miss")
                return None
            host_indices = self._alloc_host(hit, owner=Owner.PREFETCH, partial=True)
            if (
                host_indices is None
                or anchor_end + host_indices.numel() - matched < self.config.prefetch_threshold
            ):
                if host_indices is not None:
                    self.host_pool.free(host_indices)
                self.tree.unlock_host(anchor)
                self._skip("host_full")
                return None
        except BaseException:
            self.tree.unlock_host(anchor)
            raise
        n_pages = host_indices.numel() // page
        staged: list[ComponentTransfer] = []
        reads: list[tuple[list[str], list[memoryview]]] = []
        if self.components:
            got = await self._stage_components_or_free(
                storage, hashes[:n_pages], n_pages * page, host_indices, anchor
            )
            if isinstance(got, str):
                self.host_pool.free(host_indices)
                self.tree.unlock_host(anchor)
                self._skip(got)
                return None
            staged, reads = got
        prefetch = Prefetch(
            request_id=request_id,
            anchor=anchor,
            key=key[anchor_end * TOKEN_BYTES : (anchor_end + n_pages * page) * TOKEN_BYTES],
            hashes=hashes[:n_pages],
            page_keys=page_keys[:n_pages],
            host_indices=host_indices,
            page_size=page,
            stop_policy=self.config.prefetch_stop_policy,
            timeout_s=self.config.prefetch_timeout(n_pages * page),
            transfers=transfers,
            staged=staged,
            staged_reads=reads,
        )
        for transfer in transfers:  # the caller's buffers travel with the prefetch from here on
            if isinstance(transfer.pool, KVPool):
                transfer.pool.set_owner(transfer.indices, Owner.PREFETCH)
        self._prefetches[request_id] = prefetch
        self._inflight_tokens += prefetch.num_tokens
        self.metrics.prefetch_hit_tokens.inc(prefetch.num_tokens)
        assert self._task_group is not None
        self._task_group.start_soon(self._stream, prefetch, storage)
        return prefetch

    async def _stage_components_or_free(
        self,
        storage: StorageBackend,
        hashes: Sequence[bytes],
        num_tokens: int,
        host_indices: torch.Tensor,
        anchor: TreeNode,
    ) -> tuple[list[ComponentTransfer], list[tuple[list[str], list[memoryview]]]] | str:
        """`_stage_components` for a prefetch holding `host_indices` and a lock on `anchor`: if staging
        fails, or the cache closes meanwhile, the host pages, the lock and anything staged are let go."""
        got: tuple[list[ComponentTransfer], list[tuple[list[str], list[memoryview]]]] | str = "unstaged"
        try:
            got = await self._stage_components(storage, hashes, num_tokens)
            self._check_open("prefetch")
        except BaseException:
            # A pool already closed by `aclose` took its memory with it: nothing to give back there.
            if not isinstance(got, str):
                for transfer in got[0]:
                    pool = self.component_pools[transfer.component][1]  # the pool it was staged in
                    if not pool.closed:
                        pool.free(transfer.indices)
            if not self.host_pool.closed:
                self.host_pool.free(host_indices)
            self.tree.unlock_host(anchor)
            raise
        return got

    async def _stage_components(
        self, storage: StorageBackend, hashes: Sequence[bytes], num_tokens: int
    ) -> tuple[list[ComponentTransfer], list[tuple[list[str], list[memoryview]]]] | str:
        """Host buffers and page keys of every component a prefix of `num_tokens` tokens needs at its end.

        All or nothing: a skip reason when storage lacks any of the pages (a partial window, no Mamba
        state) or a component's host pool cannot take them; nothing stays allocated then.
        """
        staged: list[ComponentTransfer] = []
        reads: list[tuple[list[str], list[memoryview]]] = []
        reason: str | None = None
        try:
            for comp in self.components:
                k = min(len(hashes), comp.prefix_pages(num_tokens, self.page_size))
                keys = [component_storage_key(h, comp.name) for h in hashes[len(hashes) - k :]]
                try:
                    present = 0
                    with anyio.move_on_after(self.config.storage_read_timeout_s):
                        present = await storage.exists(keys) if keys else 0
                except StorageCircuitOpen:
                    reason = "storage_unavailable"
                    break
                except OSError as exc:  # a storage error (counted by the guard), never the caller's
                    logger.warning("prefetch: component lookup failed: %r", exc)
                    reason = "storage_error"
                    break
                if not keys or present < len(keys):
                    reason = "component_miss"
                    break
                host_pool = self.component_pools[comp.name][1]
                indices = self._alloc_component_slots(
                    comp.name, "host", k * host_pool.page_size, owner=Owner.PREFETCH
                )
                if indices is None:
                    reason = "component_host_full"
                    break
                staged.append(ComponentTransfer(comp.name, host_pool, indices))
                reads.append((keys, host_pool.page_views(indices)))
        except BaseException:
            for transfer in staged:
                transfer.pool.free(transfer.indices)
            raise
        if reason is not None:
            for transfer in staged:
                transfer.pool.free(transfer.indices)
            return reason
        return staged, reads

    def _skip(self, reason: str) -> None:
        self.metrics.prefetch_skipped.labels(reason=reason).inc()
        return None

    async def _stream(self, prefetch: Prefetch, storage: StorageBackend) -> None:
        try:
            views = self.host_pool.page_views(prefetch.host_indices)
            await prefetch.stream(
                storage,
                views,
                self.config.batch_pages,
                self.config.storage_concurrency,
                read_timeout_s=self.config.storage_read_timeout_s,
            )
        finally:
            if prefetch in self._detached:  # cancelled meanwhile: its pages go back now
                self._finish_detached(prefetch)
        page_bytes = len(views[0]) if views else 0
        self.metrics.storage_bytes_read.inc(prefetch.completed_pages * page_bytes)
        if prefetch.timed_out_reads and isinstance(storage, GuardedStorage):
            for _ in range(prefetch.timed_out_reads):  # a read that timed out is a storage error
                storage.record_timeout("get")
        if prefetch.failed_pages:
            for reason, pages in prefetch.failure_reasons.items():
                self.metrics.storage_page_failures.labels(reason=reason).inc(pages)
            self._forget_stored(prefetch.page_keys[prefetch.completed_pages :])
            self._forget_stored(prefetch.unusable_keys)  # removed by the stream; component pages too

    def _forget_stored(self, keys: Sequence[str]) -> None:
        """Storage lacks the first of `keys` (a probe or a read found it so): the writer must not take any
        of them as stored, so the next write-through of their path checks and puts them back."""
        if keys and self._storage_writer is not None:
            self._storage_writer.known.discard(keys)

    def get_prefetch(self, request_id: str) -> Prefetch:
        """The prefetch in flight for `request_id`.

        Raises:
            CacheClosed: if there is none and the cache is closed (closing resolved every prefetch).
            UnknownRequest: if there is none.
        """
        try:
            return self._prefetches[request_id]
        except KeyError:
            if self._closed:
                raise CacheClosed(
                    f"request_id: the cache was closed; no prefetch for {request_id!r}"
                ) from None
            raise UnknownRequest(f"request_id: no prefetch in flight for {request_id!r}") from None

    def _check_still_in_flight(self, request_id: str, prefetch: Prefetch) -> None:
        """After an await: the prefetch may have been resolved meanwhile (by `aclose` or another call)."""
        if self._prefetches.get(request_id) is not prefetch:
            if self._closed:
                raise CacheClosed(f"request_id: the cache was closed while {request_id!r} was prefetching")
            raise UnknownRequest(f"request_id: the prefetch for {request_id!r} was resolved meanwhile")

    def _release_prefetch_pages(
        self, prefetch: Prefetch, quiet: torch.Tensor, tail_page: int, transfers: Sequence[ComponentTransfer]
    ) -> tuple[int, int]:
        """Release `quiet` host indices, the prefetch's host pages from page `tail_page` on, and `transfers`
        in one release call; pages and staged transfers a stray read may still write into are quarantined
        instead (released once its thread returns). Returns (tokens released, of which quarantined)."""
        page = self.page_size
        tail = prefetch.host_indices[tail_page * page :]
        staged_views = {
            id(t): views for t, views in zip(prefetch.staged, prefetch.staged_views(), strict=True)
        }
        held = [t for t in transfers if stray_threads.busy(staged_views.get(id(t), ()))]
        free = [t for t in transfers if all(t is not h for h in held)]
        busy = prefetch.busy_pages(tail_page)
        if any(busy):
            mask = torch.tensor(busy, dtype=torch.bool).repeat_interleave(page)
            held_pages, tail = tail[mask], tail[~mask]
            held_views = [v for v, b in zip(prefetch.views[tail_page:], busy, strict=True) if b]
        else:
            held_pages, held_views = tail[:0], []
        released = torch.cat([quiet, tail]) if quiet.numel() else tail
        batch = self._release_buffers(released, free)
        if held_pages.numel() or held:
            views = held_views + [v for t in held for v in staged_views[id(t)]]
            self._tag_released(held_pages, held)
            self.release_queue.quarantine(held_pages, held, views=views)
            logger.warning(
                "prefetch %s: %d host pages quarantined until a stuck storage read returns",
                prefetch.request_id,
                held_pages.numel() // page,
            )
        quarantined = int(held_pages.numel())
        return batch.num_tokens + quarantined, quarantined

    async def commit_prefetch(self, request_id: str) -> PrefetchOutcome:
        """Stop the prefetch (after its stop policy), wait for its I/O, then attach or drop its pages.

        Attached: pages the tree already held and the unfetched tail are released; loaded = completed
        minus already present. Dropped (the attach point is not backed up under write-through): the host
        pages and every component transfer go to the release queue in one call; loaded = 0.

        If the caller is cancelled while waiting, the prefetch stays in flight (asked to stop) and can be
        committed or cancelled again.
        """
        prefetch = self.get_prefetch(request_id)
        await prefetch.wait_for_stop_policy()
        prefetch.request_stop()
        await prefetch.wait_stopped()  # prompt: a cancelled read abandons its threads
        self._check_still_in_flight(request_id, prefetch)
        # No await from here on: the outcome is decided and carried out atomically.
        del self._prefetches[request_id]
        self._inflight_tokens -= prefetch.num_tokens
        if prefetch.timed_out and prefetch.completed_pages < len(prefetch.page_keys):
            self.metrics.storage_page_failures.labels(reason="timeout").inc()
        completed = prefetch.completed_tokens
        page = self.page_size
        host = prefetch.host_indices
        dropped = False
        drop_reason = "anchor_not_backed_up"
        loaded = present = quarantined = 0
        node: TreeNode | None = prefetch.anchor
        if prefetch.staged and (completed < prefetch.num_tokens or not prefetch.components_complete):
            # All or nothing: a partial window or a missing state makes every page useless.
            dropped = True
            drop_reason = "component_incomplete"
        elif completed:
            result = self.tree.insert_host(
                prefetch.anchor,
                prefetch.key[: completed * TOKEN_BYTES],
                host[:completed],
                prefetch.hashes[: completed // page],
                components={t.component: t.indices for t in prefetch.staged} or None,
            )
            dropped = result.host_insert_dropped
            present = result.prefix_len
            node = result.node
        if dropped:
            # One release call: the host pages and every component transfer, in a stable order.
            released, quarantined = self._release_prefetch_pages(prefetch, host[:0], 0, prefetch.transfers)
            prefetch.state = PrefetchState.DROPPED
            self.metrics.prefetch_dropped_tokens.labels(reason=drop_reason).inc(completed)
        else:
            loaded = completed - present
            # The tree took the loaded pages and the staged component buffers (what it did not keep of
            # those is freed below).
            self.host_pool.set_owner(host[present:completed], Owner.TREE)
            for transfer in prefetch.staged:
                self.component_pools[transfer.component][1].set_owner(transfer.indices, Owner.TREE)
            caller_transfers = prefetch.transfers[: len(prefetch.transfers) - len(prefetch.staged)]
            released, quarantined = self._release_prefetch_pages(
                prefetch, host[:present], completed // page, caller_transfers
            )
            self._free_component_garbage()
            prefetch.state = PrefetchState.COMMITTED
            self.metrics.prefetch_committed.inc()
            self.metrics.prefetch_loaded_tokens.inc(loaded)
        self.tree.unlock_host(prefetch.anchor)
        self.metrics.prefetch_latency.observe(time.monotonic() - prefetch.started_at)
        outcome = PrefetchOutcome(
            request_id=request_id,
            status=prefetch.state.value,
            completed_tokens=completed,
            matched_tokens=prefetch.num_tokens,
            loaded_tokens=loaded,
            released_tokens=released,
            failed_pages=prefetch.failed_pages,
            node=node,
            quarantined_tokens=quarantined,
        )
        logger.info(
            "prefetch %s request=%s completed=%d matched=%d loaded=%d released=%d",
            outcome.status,
            request_id,
            completed,
            outcome.matched_tokens,
            loaded,
            outcome.released_tokens,
        )
        return outcome

    def _check_transfers(self, transfers: Sequence[ComponentTransfer]) -> None:
        """Refuse caller transfers holding pages the caller does not hold (a page twice included)."""
        by_pool: dict[int, tuple[KVPool, list[torch.Tensor]]] = {}
        for transfer in transfers:
            if isinstance(transfer.pool, KVPool):
                by_pool.setdefault(id(transfer.pool), (transfer.pool, []))[1].append(transfer.indices)
        for pool, parts in by_pool.values():
            pool.check_owned(torch.cat(parts), Owner.LEASE, name="transfers")

    def _release_buffers(
        self, host_indices: torch.Tensor, transfers: Sequence[ComponentTransfer]
    ) -> ReleaseBatch:
        """Hand host pages and component transfers to the release queue, tagged as pending release."""
        self._tag_released(host_indices, transfers)
        return self.release_queue.release(host_indices, transfers)

    def _tag_released(self, host_indices: torch.Tensor, transfers: Sequence[ComponentTransfer]) -> None:
        """Tag pages handed to the release queue (pending, or quarantined first) as `Owner.RELEASE`."""
        self.host_pool.set_owner(host_indices, Owner.RELEASE)
        for transfer in transfers:
            if isinstance(transfer.pool, KVPool):
                transfer.pool.set_owner(transfer.indices, Owner.RELEASE)

    async def cancel_prefetch(self, request_id: str) -> PrefetchOutcome:
        """Stop the prefetch and give its pages back.

        Waits (briefly, cancellably) for its stream to stop; pages a stuck read may still write into are
        quarantined, the rest released. If the stream has not stopped when this returns (or the caller
        is cancelled while waiting), the prefetch is resolved all the same: its pages go back as soon as
        the stream stops (`statistics().detached_prefetches` counts those), and the outcome then reports
        every page as released, none quarantined yet.
        """
        prefetch = self.get_prefetch(request_id)
        prefetch.request_stop()
        try:
            with anyio.move_on_after(_STOP_GRACE_S):
                await prefetch.wait_stopped()
        except BaseException:
            if self._prefetches.get(request_id) is prefetch:
                self._cancel_now(prefetch)  # the caller's deadline passed: resolve it detached
            raise
        self._check_still_in_flight(request_id, prefetch)
        return self._cancel_now(prefetch)

    async def _stop_and_cancel(self, prefetch: Prefetch) -> None:
        """Cleanup of a caller already cancelled: stop the stream, wait (shielded, at most `_STOP_GRACE_S`;
        a stream stops within a few loop turns) so its pages go back before the caller's error
        propagates, then resolve it; if it has not stopped by then, it is resolved detached."""
        prefetch.request_stop()
        # A second asyncio cancellation (anyio's shield does not stop those) ends the wait: detached.
        with (
            anyio.CancelScope(shield=True),
            anyio.move_on_after(_STOP_GRACE_S),
            contextlib.suppress(asyncio.CancelledError),
        ):
            await prefetch.wait_stopped()
        if self._prefetches.get(prefetch.request_id) is prefetch:
            self._cancel_now(prefetch)

    def _cancel_now(self, prefetch: Prefetch) -> PrefetchOutcome:
        """Resolve `prefetch` as cancelled without awaiting: its pages go back now if its stream has
        stopped, otherwise when it stops (`_finish_detached`)."""
        request_id = prefetch.request_id
        prefetch.request_stop()
        del self._prefetches[request_id]
        self._inflight_tokens -= prefetch.num_tokens
        prefetch.state = PrefetchState.CANCELLED
        self.tree.unlock_host(prefetch.anchor)
        self.metrics.prefetch_cancelled.inc()
        if prefetch.done:
            released, quarantined = self._release_prefetch_pages(
                prefetch, prefetch.host_indices[:0], 0, prefetch.transfers
            )
        else:
            self._detached.add(prefetch)
            released, quarantined = prefetch.num_tokens, 0
        logger.info(
            "prefetch cancelled request=%s completed=%d matched=%d loaded=0 released=%d quarantined=%d%s",
            request_id,
            prefetch.completed_tokens,
            prefetch.num_tokens,
            released,
            quarantined,
            "" if prefetch.done else " (once its stream stops)",
        )
        return PrefetchOutcome(
            request_id=request_id,
            status=PrefetchState.CANCELLED.value,
            completed_tokens=prefetch.completed_tokens,
            matched_tokens=prefetch.num_tokens,
            loaded_tokens=0,
            released_tokens=released,
            failed_pages=prefetch.failed_pages,
            node=prefetch.anchor,
            quarantined_tokens=quarantined,
        )

    def _finish_detached(self, prefetch: Prefetch) -> None:
        """The stream of a cancelled prefetch stopped (or will never run): give its pages back."""
        self._detached.discard(prefetch)
        self._release_prefetch_pages(prefetch, prefetch.host_indices[:0], 0, prefetch.transfers)


async def _wait_uncancelled(work: Awaitable[None]) -> None:
    """Await `work` to its end even if the caller is cancelled meanwhile, then re-raise the cancellation.

    anyio's shielded scopes do not stop asyncio's own cancellation (`asyncio.timeout`, `wait_for`,
    `Task.cancel`), so the work runs in a task of its own and a cancellation of the caller only ends the
    caller's wait once the work is done. For short work that must never be abandoned (a copy into a
    buffer the caller frees on its way out).
    """
    task = asyncio.ensure_future(work)
    try:
        await asyncio.shield(task)
    except BaseException:
        # Cancelled (or the work failed): wait for the work; anyio's re-deliveries are shielded, a second
        # asyncio cancellation is absorbed, the first exception is what propagates.
        with anyio.CancelScope(shield=True):
            while not task.done():
                try:
                    await asyncio.wait([task])
                except asyncio.CancelledError:
                    continue
        if not task.cancelled():
            task.exception()  # retrieved, whatever it is: never logged as "never retrieved"
        raise


def _check_request_id(request_id: object) -> None:
    """Refuse a request id that is not a non-empty str (naming `request_id`), with or without storage."""
    if not isinstance(request_id, str):
        raise TypeError(
            f"request_id: expected a non-empty str, got {type(request_id).__name__} {request_id!r}"
        )
    if not request_id:
        raise ValueError("request_id: expected a non-empty str, got ''")


def _check_owners(
    pool: KVPool,
    label: str,
    claims: Mapping[Owner, Sequence[torch.Tensor]],
    loose: Sequence[torch.Tensor],
    held_tokens: int,
    out: list[str],
) -> None:
    """Check that `pool`'s owner tags are exactly the partition `claims` describes (see `sanity_check`).

    `claims` maps an owner to the indices found held by it; `loose` indices may carry any tag but must be
    allocated. Without an `Owner.LEASE` claim, pages tagged LEASE and found nowhere are the caller's:
    they must hold `held_tokens` indices.
    """
    size = pool.page_size
    tags = pool.owner_tags().to(torch.int64)
    num_pages = int(tags.numel())
    expected = torch.zeros(num_pages, dtype=torch.int64)  # Owner.FREE: found nowhere
    claimed = torch.zeros(num_pages, dtype=torch.int64)
    claim_sets: list[tuple[str, list[torch.Tensor]]] = [(o.name, list(p)) for o, p in claims.items()]
    claim_sets.append(("queued free", list(loose)))
    is_loose = torch.zeros(num_pages, dtype=torch.bool)
    for name, parts in claim_sets:
        parts = [p for p in parts if p.numel()]
        if not parts:
            continue
        indices = torch.cat(parts)
        if int(indices.min()) < 0 or int(indices.max()) >= num_pages * size:
            out.append(f"{label}: {name} holds indices outside the pool")
            continue
        if torch.unique(indices).numel() != indices.numel():
            out.append(f"{label}: {name} holds the same index more than once")
        pages = torch.unique(indices // size)
        claimed[pages] += 1
        if name == "queued free":
            is_loose[pages] = True
        else:
            expected[pages] = int(Owner[name])
    twice = (claimed > 1).nonzero().flatten()
    if twice.numel():
        out.append(f"{label}: pages {twice[:8].tolist()} are held by more than one owner")
    free = tags == int(Owner.FREE)
    claimed_free = (free & (claimed > 0)).nonzero().flatten()
    if claimed_free.numel():
        out.append(f"{label}: pages {claimed_free[:8].tolist()} are held but free in the pool")
    mismatch = (tags != expected) & ~is_loose & ~free
    if Owner.LEASE not in claims:
        lease = (tags == int(Owner.LEASE)) & (expected == int(Owner.FREE))
        mismatch &= ~lease
        held = int(lease.sum()) * size
        if held != held_tokens:
            out.append(f"{label}: the caller holds {held} indices, expected {held_tokens}")
    for page in mismatch.nonzero().flatten()[:8].tolist():
        found = Owner(int(expected[page])).name if claimed[page] else "nowhere"
        out.append(f"{label}: page {page} is tagged {Owner(int(tags[page])).name} but found {found}")
    if int(free.sum()) != pool.statistics().free_pages:
        out.append(
            f"{label}: {int(free.sum())} pages tagged free, the pool counts {pool.statistics().free_pages}"
        )


def _depth(node: TreeNode) -> int:
    """Tokens from the root to the end of `node`."""
    depth = 0
    current: TreeNode | None = node
    while current is not None:
        depth += current.num_tokens
        current = current.parent
    return depth
