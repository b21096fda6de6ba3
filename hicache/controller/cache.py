"""`HiCache`: the object a serving loop embeds. The tree decides, this class executes.

It owns the radix tree, the device and host pools, the storage backend, the release queue and the
background workers (an asyncio task group): device->host backups, host->storage write-through, prefetch
streams; the work itself is done by collaborators each handed only what it needs (`Allocator`,
`TierMover`, `Admission`, `Prefetches`, `Leases`, `Accounting`, `Workers`). Every method that changes the tree does so synchronously between
awaits, so the tree is always consistent when another coroutine runs; every await that may touch a
buffer is cancellation-safe: a device <-> host copy is waited for even when the caller is cancelled (a
copy is short and cannot be abandoned), and a storage read is abandoned at once, its buffers quarantined
until its thread returns.

Deadlines: every awaitable public method honours the caller's cancellation, from `asyncio.timeout`,
`asyncio.wait_for` and `Task.cancel` alike, and returns within a few event-loop turns of it, plus at most the device <-> host
copy in flight (never a storage I/O: a stuck read or write is abandoned). `aclose()` returns within
`config.close_timeout_s`. Storage calls run under `storage_read_timeout_s` / `storage_write_timeout_s`.
"""

from __future__ import annotations

import asyncio
import logging
import warnings
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Self

import torch

from hicache.components import Component
from hicache.config import HiCacheConfig
from hicache.controller.accounting import Accounting
from hicache.controller.leases import Leases
from hicache.controller.movement.copies import CopyTracker
from hicache.controller.movement.layered_load import LayeredLoader
from hicache.controller.movement.tier_mover import TierMover
from hicache.controller.pages.allocation import Allocator, ComponentPools, make_pools
from hicache.controller.pages.release import ComponentTransfer, ReleaseQueue
from hicache.controller.prefetch.admission import Admission
from hicache.controller.prefetch.job import Prefetch, Prefetches, PrefetchOutcome
from hicache.controller.prefetch.rescue import RefillRescue
from hicache.controller.results import CacheStatistics, ComponentPoolStatistics, Lease
from hicache.controller.state import OpenState
from hicache.controller.storage.guarded import CircuitBreaker, GuardedStorage
from hicache.controller.storage.writer import StorageWriter
from hicache.controller.workers import Workers
from hicache.errors import UnsupportedEventLoop
from hicache.keys import KeyLike, as_key_bytes
from hicache.memory import KVPool, Owner, check_token_indices
from hicache.metrics import CacheMetrics, CollectorRegistry, default_cache_metrics, rank_labels
from hicache.parallel import Agreement, RankFailed, check_same_pools, check_same_tree, check_same_tree_async
from hicache.policy import RefillPolicy
from hicache.tiers import SkipReason, Tier
from hicache.tree import InsertResult, MatchResult, RadixTree
from storage_backends.cancellation import run_in_thread
from storage_backends.protocol import StorageBackend
from storage_backends.registry import open_backend

__all__ = ["CacheStatistics", "HiCache", "Lease"]

logger = logging.getLogger("hicache.cache")


class HiCache:
    """A hierarchical KV cache: radix tree over device and host pools, with an optional storage tier.

    Use it as an async context manager::

        async with HiCache(config) as cache:
            lease = await cache.acquire("req-1", tokens)
            ...  # compute KV for tokens[lease.cached_len:] into pages from `await cache.alloc_device(n)`
            await cache.insert(lease, tokens, indices)

    The work is done by collaborators, each handed only what it needs: an `Allocator` (pages, with
    eviction), a `TierMover` (backups, write-through, load-back), an `Admission` and `Prefetches` (admission, streaming,
    commit, cancel) and the `Accounting` check; this class checks arguments, starts and closes them
    (`start`, `aclose`), and shows what they hold (`statistics`, `repr`, `sanity_check`).

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
        self._tree = RadixTree(
            config.page_size,
            write_policy=config.write_policy,
            eviction_policy=config.eviction_policy,
            write_through_threshold=config.write_through_threshold,
            namespace=config.namespace,
            components=config.components or None,
        )
        self.components: tuple[Component, ...] = self._tree.components
        """The hybrid components (sliding window, Mamba state) the cache keeps beside full-attention KV."""
        pools = make_pools(config, self.components, device_pool, host_pool)
        self._device_pool, self._host_pool = pools.device, pools.host
        self._component_pools: dict[str, ComponentPools] = pools.components
        self.storage: StorageBackend | None = storage
        self._owns_storage = storage is None
        self.registry = metrics if metrics is not None else CollectorRegistry()
        self.metrics: CacheMetrics = default_cache_metrics(
            self.registry, const_labels=rank_labels(config.namespace)
        )
        self._release_queue = ReleaseQueue(
            self._host_pool, batch_tokens=config.release_batch_pages * self.page_size
        )
        self.storage_breaker = (
            storage_breaker if storage_breaker is not None else CircuitBreaker.for_storage(config)
        )
        breaker_gauge = self.metrics.storage_breaker_state.labels(tier=self.storage_breaker.tier)
        breaker_gauge.set(self.storage_breaker.state)
        self.storage_breaker.listeners.append(lambda old, new: breaker_gauge.set(new))
        self._state = OpenState()
        self._copies = CopyTracker()
        tree, device, host, comps, queue = (
            self._tree,
            self._device_pool,
            self._host_pool,
            self._component_pools,
            self._release_queue,
        )
        breaker, counters, state = self.storage_breaker, self.metrics, self._state
        self.agreement = Agreement(config.tp_group)
        """The agreement of this rank's decisions with its tensor-parallel peers: for one rank (no group,
        or a group of one) every decision resolves as it is settled, with no step and no collective."""
        self._allocator = Allocator(tree, device, host, comps, queue, agreement=self.agreement)
        self._mover = TierMover(
            config,
            tree,
            device,
            host,
            comps,
            self._allocator,
            self._copies,
            counters,
            breaker,
            self.agreement,
        )
        self._prefetches = Prefetches(config, tree, self._allocator, counters, state, self.agreement)
        self._admission = Admission(
            config, tree, self._allocator, counters, state, self.agreement, self._prefetches
        )
        if config.refill_under_unbacked is RefillPolicy.BACKUP_THEN_ATTACH:
            self._prefetches.rescue = RefillRescue(tree, self._mover)
        self._loader = LayeredLoader(tree, device, host, self._mover, self._copies, counters, self.agreement)
        self._leases = Leases(
            tree,
            device,
            comps,
            self._allocator,
            self._mover,
            self._prefetches,
            self._admission,
            state,
            self._loader,
            config.layerwise_load_back,
        )
        self._accounting = Accounting(
            tree, device, host, comps, queue, self._copies, self._prefetches.all_in_flight
        )
        self._workers = Workers(
            f"hicache-workers-{id(self):x}",
            release_queue=queue,
            mover=self._mover,
            prefetches=self._prefetches,
            copies=self._copies,
            owned_pools=pools.owned,
            close_timeout_s=config.close_timeout_s,
            on_failure=self._background_failed,
        )

    # ------------------------------------------------------------------ tensor parallelism

    async def tp_sync(self) -> int:
        """Under tensor parallelism, step until no rank has a decision pending (call it on every rank at
        the same point, a scheduling step's end); returns the steps (0 without a TP group).

        Raises:
            RankFailed: a peer died or stopped responding for longer than the group's timeout.
        """
        return await self.agreement.drive(lambda: False)

    # ------------------------------------------------------------------ observing

    @property
    def device_pool(self) -> KVPool:
        """The device KV pool: the model writes a request's new KV into pages from `alloc_device` here,
        and reads a lease's prefix (`lease.device_indices`) from it."""
        return self._device_pool

    def component_pool(self, name: str) -> KVPool:
        """The device pool of hybrid component `name`: the model writes the slots from `alloc_component`
        and reads `lease.component_indices[name]` there.

        Raises:
            ValueError: naming `name` when the cache has no such component.
        """
        if name not in self._component_pools:
            raise ValueError(f"name: unknown component {name!r}")
        return self._component_pools[name].device

    async def wait_idle(self) -> None:
        """Wait until no backup, storage write or release is queued or running.

        Returns at once when the cache is closed or closing (queued work is dropped then). Quarantined
        pages are not waited for: a stuck read may never return. Under tensor parallelism backups and
        write-through finish at agreement steps: this is then a collective (`tp_sync` first), to call on
        every rank at the same point.

        Raises:
            CacheFailed: a background job failed (before or during the wait): the work is lost.
            UnsupportedEventLoop: on another event loop than `start()`'s (the workers never run here).
        """
        self._state.check_loop("wait_idle")
        if not self._state.closed:
            await self.tp_sync()
        backups, writes = self._mover.backups, self._mover.storage_writes
        # A backup queues a storage write and both free pages: wait until all three are quiet at once.
        while not self._state.closed:
            await backups.wait_idle()
            await writes.wait_idle()
            if self._state.closed:
                break
            await self._release_queue.drain()
            if backups.idle and writes.idle:
                break
        if self._state.failure is not None:
            raise self._state.closed_error("wait_idle")

    # ------------------------------------------------------------------ matching and leases

    def match(self, tokens: KeyLike) -> MatchResult:
        """Match `tokens` against the tree: device hit, host hit beyond it, last device and host nodes."""
        return self._tree.match_prefix(tokens)

    async def acquire(self, request_id: str, tokens: KeyLike, *, prefetch: bool = True) -> Lease:
        """Match, prefetch storage hits and commit them, load host hits back, and lock the prefix.

        Args:
            request_id: a unique id for the request while it holds the lease.
            tokens: the request's token ids.
            prefetch: False to leave storage alone (no lookup, no read): the lease holds what the device
                and host tiers have, so the call never waits on storage (an engine step loading host hits
                synchronously; a prefetch it already committed).

        Returns:
            A `Lease` whose `device_indices` hold the KV of `tokens[:cached_len]` on the device pool.

        Raises:
            CacheClosed: the cache is closed, or was closed during the call (`CacheFailed` after a
                background failure).
        """
        self._state.check_open("acquire")
        _check_request_id(request_id)
        if not isinstance(prefetch, bool):
            raise TypeError(f"prefetch: expected a bool, got {type(prefetch).__name__}")
        try:
            return await self._leases.acquire(
                request_id, as_key_bytes(tokens, name="tokens"), prefetch=prefetch
            )
        except Exception as exc:
            if self._state.closed:  # closed during the call: say so, not which inner step noticed
                raise self._state.closed_error("acquire", "this HiCache was closed during the call") from exc
            raise

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
            TypeError: naming `lease` when it is not a `Lease`, `device_indices` or a component's indices
                when they are not a 1-D int64 CPU tensor (a numpy array would free nothing).
            PoolError: naming `device_indices` or `components`, when an index is not one the caller holds
                (out of range, misaligned, repeated, free, held by the tree or in flight); nothing is
                freed and the lease stays as it was then.
        """
        _check_lease(lease)
        if device_indices is not None:
            check_token_indices(device_indices, name="device_indices")
        if isinstance(components, Mapping):
            for name, indices in components.items():
                check_token_indices(indices, name=f"components[{name!r}]")
        self._leases.release(lease, device_indices, components)

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
            TypeError: naming `lease` when it is not a `Lease`, or `device_indices` when it is not an
                int64 tensor.
            ValueError, PoolError: naming `device_indices` when it has the wrong length, does not start
                with the lease's prefix, or holds a page the caller does not hold (out of range,
                negative, misaligned, repeated, never allocated, freed, in the tree, in flight);
                naming `components` likewise for component slots; naming `lease` or `tokens` for a
                released lease or tokens not extending its prefix. Nothing changes then: the pools,
                the tree and the lease stay as they were.
        """
        _check_lease(lease)
        return await self._leases.insert(lease, tokens, device_indices, components)

    # ------------------------------------------------------------------ allocation

    def alloc_component(self, name: str, num_slots: int) -> torch.Tensor | None:
        """Allocate device slots of component `name` (whole pages), evicting its unlocked values if needed.

        Returns None when not enough can be evicted. Pass the indices to `insert(components=...)`. Under
        tensor parallelism the eviction is agreed across the ranks: use `alloc_components_async` there.

        Raises:
            ValueError: an unknown component or a count that is not a multiple of its page size.
            RuntimeError: under tensor parallelism (naming `alloc_components_async`).
        """
        self._check_component_request(name, num_slots)
        if not self.agreement.local:
            raise RuntimeError(
                "alloc_component: under tensor parallelism the ranks agree what to evict; call "
                "`await cache.alloc_components_async({name: num_slots})` on every rank"
            )
        return self._allocator.alloc_component_slots(name, Tier.DEVICE, num_slots, owner=Owner.LEASE)

    async def alloc_components_async(self, slots: Mapping[str, int]) -> dict[str, torch.Tensor | None]:
        """`alloc_component` for each component of `slots` (name -> slots), for any number of ranks.
        Under tensor parallelism it is an engine call (every rank makes it, in the same order): one
        agreement step agrees, per component, the most slots any rank lacks, every rank evicts that
        much, and for each component every rank gets its slots or every rank gets None. With one rank it
        is `alloc_component` for each.

        Raises:
            TypeError: naming `slots` when it is not a mapping.
            ValueError: an unknown component or a count that is not a multiple of its page size.
        """
        if not isinstance(slots, Mapping):
            raise TypeError(f"slots: expected a mapping of component name to slots, got {slots!r:.80}")
        for name, num_slots in slots.items():
            self._check_component_request(name, num_slots)
        wants = [(name, Tier.DEVICE, n) for name, n in slots.items()]
        got = await self._allocator.take_component_slots(wants, owner=Owner.LEASE, key="lease")
        return dict(zip(slots, got, strict=True))

    def _check_component_request(self, name: str, num_slots: int) -> None:
        self._state.check_open("alloc_component")
        if not isinstance(name, str):
            raise TypeError(f"name: expected a component name (str), got {name!r:.80}")
        if name not in self._component_pools:
            raise ValueError(f"name: unknown component {name!r}")
        page = self._component_pools[name].device.page_size
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 0 or num_slots % page:
            raise ValueError(f"num_slots: expected a non-negative multiple of {page}, got {num_slots!r}")

    async def alloc_device(self, num_tokens: int) -> torch.Tensor | None:
        """Allocate device pages for `num_tokens` (a multiple of the page size), evicting as needed.

        Succeeds whenever free device pages and the device pages of nodes without a device or host lock
        can make room, under every write policy and host size. Under write-back, evicted nodes are backed
        up to host first while their un-backed chains fit there, and dropped beyond that. Returns None
        when not enough can be evicted (running out is a value, not an error).
        """
        self._state.check_open("alloc_device")
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int):
            raise TypeError(f"num_tokens: expected an int, got {type(num_tokens).__name__}")
        if num_tokens < 0 or num_tokens % self.page_size:
            raise ValueError(
                f"num_tokens: expected a non-negative multiple of {self.page_size}, got {num_tokens}"
            )
        return await self._mover.alloc_device(num_tokens)

    async def load_back(self, match: MatchResult) -> MatchResult:
        """Copy the host-only part of a match back to device and return the fresh match.

        If device memory cannot be found the match is returned unchanged (a value, not an error).

        Raises:
            TypeError: naming `match` when it is not a `MatchResult`.
        """
        self._state.check_open("load_back")
        _check_match(match)
        return await self._mover.load_back(match)

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
            TypeError: naming `match` when it is not a `MatchResult`, or `transfers` when it is not a
                sequence of `ComponentTransfer`.
            ValueError: naming `request_id` when it is empty or already has a prefetch in flight, or
                `match` when it matched other tokens.
            PoolError: naming `transfers` when one holds an index the caller does not hold.
        """
        self._state.check_open("prefetch")
        _check_request_id(request_id)
        if match is not None:
            _check_match(match)
        if isinstance(transfers, (str, ComponentTransfer)) or not isinstance(transfers, Sequence):
            raise TypeError(f"transfers: expected a sequence of ComponentTransfer, got {transfers!r:.80}")
        for transfer in transfers:
            if not isinstance(transfer, ComponentTransfer):
                raise TypeError(f"transfers: expected ComponentTransfer items, got {transfer!r:.80}")
        started = await self._admission.start(request_id, tokens, match, transfers)  # converts tokens
        return None if isinstance(started, SkipReason) else started

    async def commit_prefetch(self, request_id: str) -> PrefetchOutcome:
        """Stop the prefetch (after its stop policy), wait for its I/O, then attach or drop its pages.

        Attached: pages the tree already held and the unfetched tail are released; loaded = completed
        minus already present. Dropped (the attach point is not backed up under write-through): the host
        pages and every component transfer go to the release queue in one call; loaded = 0.

        If the caller is cancelled while waiting, the prefetch stays in flight (asked to stop) and can be
        committed or cancelled again.

        Raises:
            TypeError, ValueError: naming `request_id` when it is not a non-empty str.
            UnknownRequest: when no prefetch is in flight for it.
        """
        _check_request_id(request_id)
        return await self._prefetches.commit(request_id)

    async def cancel_prefetch(self, request_id: str) -> PrefetchOutcome:
        """Stop the prefetch and give its pages back.

        Waits (briefly, cancellably) for its stream to stop; pages a stuck read may still write into are
        quarantined, the rest released. If the stream has not stopped when this returns (or the caller
        is cancelled while waiting), the prefetch is resolved all the same: its pages go back as soon as
        the stream stops (`statistics().detached_prefetches` counts those), and the outcome then reports
        every page as released, none quarantined yet.
        """
        _check_request_id(request_id)
        return await self._prefetches.cancel(request_id)

    def get_prefetch(self, request_id: str) -> Prefetch:
        """The prefetch in flight for `request_id`.

        Raises:
            CacheClosed: if there is none and the cache is closed (closing resolved every prefetch).
            UnknownRequest: if there is none.
        """
        _check_request_id(request_id)
        return self._prefetches.get(request_id)

    # ------------------------------------------------------------------ start and close

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

        Raises:
            UnsupportedEventLoop: no asyncio loop runs, or the cache was started on another event loop.
            CacheClosed: the cache was closed (`CacheFailed` after a background failure).
        """
        self._state.check_loop("start")
        if self._state.closed:
            raise self._state.closed_error("start")
        if self._state.started:
            return
        try:
            loop = asyncio.get_running_loop()
        except (
            RuntimeError
        ):  # no asyncio loop (trio, say): the read threads' eventfd and the pacer need asyncio's loop
            raise UnsupportedEventLoop(
                "start: HiCache runs on asyncio; no asyncio event loop is running"
            ) from None
        try:
            if self.storage is None and self.config.storage_url is not None:
                self.storage = open_configured_storage(self.config)
            if self.storage is not None:
                self._open_storage_tier(self.storage)
            if self._device_pool.device.type == "cuda":
                # One thread enqueues every large CUDA copy plan: concurrent load-backs each launching
                # thousands of page copies from their own threads fight over the GIL (on an H200, 16
                # concurrent load-backs of 128 KiB pages ran at a quarter of one load-back's rate).
                self._copies.limiter = asyncio.Semaphore(1)
            if not self.agreement.local:
                await run_in_thread(check_same_pools, self.config)
            await self._workers.start(self.storage if self._owns_storage else None)
        except BaseException:
            # A failed start: close what it opened and the pools; the cache stays closed.
            self._state.close()
            await self._workers.abort(self.storage if self._owns_storage else None)
            raise
        self._state.open(loop)

    def _open_storage_tier(self, storage: StorageBackend) -> None:
        """Put `storage` behind the breaker and hand it to the prefetches and the write-through."""
        guarded = GuardedStorage(storage, self.storage_breaker, self.metrics.storage_errors)
        writer = StorageWriter(
            guarded,
            tree=self._tree,
            host_pool=self._host_pool,
            component_pools=self._component_pools,
            release_queue=self._release_queue,
            metrics=self.metrics,
            read_timeout_s=self.config.storage_read_timeout_s,
            write_timeout_s=self.config.storage_write_timeout_s,
        )
        self._mover.writer = writer
        self._prefetches.storage = guarded
        self._prefetches.known = writer.known
        warn_if_shared(self.config)

    async def aclose(self) -> None:
        """Cancel prefetches, stop the workers, release everything, close storage and the pools made here.

        Idempotent, and bounded: returns within `config.close_timeout_s` (or the caller's own deadline,
        whichever is first). What is left then (a stuck storage thread, pages it may still write into) is
        logged and finishes in the background: buffers are released, and the pools the cache made are
        closed, only once no read or copy can write into them. Pools passed to the constructor stay open.
        After a background failure (`CacheFailed`) it finishes the shutdown that failure began.

        On another event loop than `start()`'s (whose workers cannot run here) it closes the cache, asks
        `start()`'s loop to shut the workers down when it next runs, closes the pools the cache made now
        if that loop is not running, and returns.
        """
        home = self._state.loop
        if home is not None and self._state.on_another_loop():
            if not self._state.closed:
                self._state.close()
                if not home.is_closed():
                    home.call_soon_threadsafe(self._begin_close)
            logger.warning("%r: aclose on another event loop than start's: the workers run there", self)
            if not home.is_running():
                self._workers.close_pools()
            return
        if not self._state.closed:
            self._state.close()
            self._begin_close()
        await self._workers.wait_closed()

    def _begin_close(self) -> None:
        """The cache closes (its state says closed already): cancel the prefetches, fail the agreement and
        stop the workers."""
        self._prefetches.cancel_all()
        reason = "failed" if self._state.failure is not None else "was closed"
        self.agreement.fail(RankFailed(f"rank {self.agreement.tp_rank}: the cache {reason}"))
        self._workers.begin_close()

    def _background_failed(self, job: str, error: Exception) -> None:
        """A background job raised `error` (`Workers`' `on_failure`): log it once, fail the cache (every
        later call raises `CacheFailed`) and close it as `aclose()` would; `aclose()` then finishes."""
        if not self._state.fail(error):
            logger.warning("%r: background job %s raised after the cache closed: %r", self, job, error)
            return
        logger.error(
            "%r: background job %s failed; the cache is closed and every call now raises CacheFailed",
            self,
            job,
            exc_info=error,
        )
        self._begin_close()

    def __del__(self) -> None:
        # getattr: a constructor that raised never set the state, and must not fail again here.
        state = getattr(self, "_state", None)
        if state is not None and state.started and not state.closed:
            warnings.warn(f"unclosed {self!r}", ResourceWarning, stacklevel=1)

    # ------------------------------------------------------------------ what the cache shows of itself

    def statistics(self) -> CacheStatistics:
        """A frozen snapshot of the tree, the pools, the release queue and the work in flight."""
        release = self._release_queue.statistics()
        return CacheStatistics(
            tree=self._tree.statistics(),
            device_pool=self._device_pool.statistics(),
            host_pool=self._host_pool.statistics(),
            release_queue=release,
            prefetches_in_flight=len(self._prefetches),
            prefetch_tokens_in_flight=self._prefetches.inflight_tokens,
            backups_queued=len(self._mover.backups),
            storage_writes_queued=len(self._mover.storage_writes),
            closed=self._state.closed,
            quarantined_pages=release.quarantined_tokens // self.page_size,
            detached_prefetches=self._prefetches.detached,
            backups_queued_max=self._mover.backups.max_queued,
            storage_writes_queued_max=self._mover.storage_writes.max_queued,
            storage_breaker=self.storage_breaker.statistics() if self.storage is not None else None,
            component_pools={
                name: ComponentPoolStatistics(pools.device.statistics(), pools.host.statistics())
                for name, pools in self._component_pools.items()
            },
            components=self._tree.component_statistics(),
        )

    def __repr__(self) -> str:
        t = self._tree.statistics()
        d, h = self._device_pool.statistics(), self._host_pool.statistics()
        state = "closed" if self._state.closed else "open" if self._state.started else "new"
        storage = type(self.storage).__name__ if self.storage is not None else None
        return (
            f"<HiCache {state} policy={self.config.write_policy.value} page_size={self.page_size} "
            f"nodes={t.num_nodes} device={d.used_pages}/{d.capacity_pages} pages "
            f"host={h.used_pages}/{h.capacity_pages} pages prefetches={len(self._prefetches)} "
            f"quarantined={self._release_queue.statistics().quarantined_tokens // self.page_size} pages "
            f"storage={storage}>"
        )

    def sanity_check(
        self,
        *,
        held_device_tokens: int = 0,
        held_component_slots: Mapping[str, int] | None = None,
        held_device: Sequence[torch.Tensor] | None = None,
        held_components: Mapping[str, Sequence[torch.Tensor]] | None = None,
        across_ranks: bool = False,
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
            across_ranks: also compare this rank's tree fingerprint (structure, tiers, backed-up flags,
                locks) with every other rank's: a collective, so call it on every rank at the same point,
                between cache calls; it blocks the thread, event loop included, until every rank has
                called it (at most the group's timeout): on an event loop, prefer
                `await sanity_check_async(across_ranks=True)`. Without a TP group there is nothing to
                compare.

        Raises:
            InvariantViolation: listing every violation found.
            TreeDivergence: the ranks' trees differ; the message names the first differing node.
            RankFailed: a peer died or stopped responding.
        """
        if across_ranks and self.config.tp_group is not None:
            check_same_tree(self.config.tp_group, self._tree)
        self._accounting.check(
            held_device_tokens=held_device_tokens,
            held_component_slots=held_component_slots,
            held_device=held_device,
            held_components=held_components,
        )

    async def sanity_check_async(
        self,
        *,
        held_device_tokens: int = 0,
        held_component_slots: Mapping[str, int] | None = None,
        held_device: Sequence[torch.Tensor] | None = None,
        held_components: Mapping[str, Sequence[torch.Tensor]] | None = None,
        across_ranks: bool = False,
    ) -> None:
        """`sanity_check`, with the cross-rank comparison run off the event loop: the local checks and
        the fingerprint run on the loop, at the call (the tree as it is then); the collectives run in a
        worker thread bounded by the group's timeout, so other tasks (a peer's pace, the cache's own
        background work) keep running while the ranks meet. Same arguments and errors as `sanity_check`.
        """
        self._accounting.check(
            held_device_tokens=held_device_tokens,
            held_component_slots=held_component_slots,
            held_device=held_device,
            held_components=held_components,
        )
        if across_ranks and self.config.tp_group is not None:
            await check_same_tree_async(self.config.tp_group, self._tree)


def _check_request_id(request_id: object) -> None:
    """Refuse a request id that is not a non-empty str (naming `request_id`), with or without storage."""
    if not isinstance(request_id, str):
        raise TypeError(
            f"request_id: expected a non-empty str, got {type(request_id).__name__} {request_id!r}"
        )
    if not request_id:
        raise ValueError("request_id: expected a non-empty str, got ''")


def _check_lease(lease: object) -> None:
    """Refuse a lease that is not a `Lease` (naming `lease`) before anything reads its fields."""
    if not isinstance(lease, Lease):
        raise TypeError(f"lease: expected a Lease from acquire, got {type(lease).__name__}")


def open_configured_storage(config: HiCacheConfig) -> StorageBackend:
    """Open the backend of `config.storage_url` (which must be set) with `config.storage_options`, plus
    the cache's timeouts for a client that has its own (S3, Valkey, Mooncake: per-round-trip read and write deadlines),
    unless the options set them."""
    url = config.storage_url
    assert url is not None
    options = dict(config.storage_options)
    if url.startswith(("s3://", "valkey://", "mooncake://")):
        options.setdefault("read_deadline_s", config.storage_read_timeout_s)
        options.setdefault("write_deadline_s", config.storage_write_timeout_s)
    return open_backend(url, namespace_digest=config.namespace.digest, **options)


def warn_if_shared(config: HiCacheConfig) -> None:
    """Warn when a storage tier is used without a model id: every cache with the same KV layout and an
    empty model id would share pages with this one."""
    if not config.namespace.model_id:
        logger.warning(
            "HiCache has a storage tier but namespace.model_id is empty: every cache with the "
            "same KV layout and an empty model_id shares pages with this one; pass "
            "Namespace(model_id=<model name and revision, or a config hash>)"
        )


def _check_match(match: object) -> None:
    """Refuse a match that is not a `MatchResult` (naming `match`) before anything reads its fields."""
    if not isinstance(match, MatchResult):
        raise TypeError(f"match: expected a MatchResult from match(), got {type(match).__name__}")
