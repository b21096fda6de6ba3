"""Moving pages between tiers: device -> host backups (and the device eviction that needs them), host ->
storage write-through, and host -> device load-back."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence

import torch

from hicache.components import Component
from hicache.config import HiCacheConfig
from hicache.controller.movement.agreed_backups import AgreedBackup, AgreedBackups, AgreedStore
from hicache.controller.movement.copies import CopyTracker
from hicache.controller.movement.work_queue import WorkQueue
from hicache.controller.pages.allocation import Allocator, ComponentPools
from hicache.controller.storage.guarded import CircuitBreaker
from hicache.controller.storage.writer import StorageWriter
from hicache.errors import StorageCircuitOpen
from hicache.keys import TOKEN_BYTES
from hicache.memory import KVPool, Owner
from hicache.metrics import CacheMetrics
from hicache.parallel.agreement import Agreement, decode_max, encode_max
from hicache.tiers import ShedReason, Tier
from hicache.tree import MatchResult, NodeRef, RadixTree
from storage_backends.cancellation import StopScope

__all__ = ["TierMover"]

logger = logging.getLogger("hicache.cache")

_MAX_BATCH = 64
"""Most queued backups (or storage writes) one background job takes: one device->host copy (or one storage
`put`) then serves every request that queued work meanwhile, so a saturated loop still drains the queues."""

_BACKPRESSURE_WAIT_S = 0.005
"""The most one `insert` waits for a background queue above half its limit to drain below it."""

# (node, component) -> (source indices, destination indices) of a component copy.
_ComponentCopies = dict[tuple[NodeRef, str], tuple[torch.Tensor, torch.Tensor]]


class TierMover:
    """Carries out the tree's moves between tiers, with the background queues of backups and writes.

    Args:
        config: the cache's configuration (queue limits, `backup_to_storage`).
        tree: the radix tree that plans every move.
        device_pool, host_pool, component_pools: the pools pages move between.
        allocator: takes host and component pages (evicting as needed).
        copies: runs and counts device <-> host copies.
        metrics: the cache's metric set.
        storage_breaker: the storage tier's breaker (write-through is shed while it is open).
        agreement: the ranks' agreement (for one rank its decisions resolve at once): device allocation,
            load-backs, backups and write-through locks are agreed with it (`AgreedBackups`).
    """

    def __init__(
        self,
        config: HiCacheConfig,
        tree: RadixTree,
        device_pool: KVPool,
        host_pool: KVPool,
        component_pools: Mapping[str, ComponentPools],
        allocator: Allocator,
        copies: CopyTracker,
        metrics: CacheMetrics,
        storage_breaker: CircuitBreaker,
        agreement: Agreement,
    ) -> None:
        self._config = config
        self._agreement = agreement
        self._tree = tree
        self._components: tuple[Component, ...] = tree.components
        self._device_pool = device_pool
        self._host_pool = host_pool
        self._component_pools = component_pools
        self._allocator = allocator
        self._copies = copies
        self._metrics = metrics
        self._breaker = storage_breaker
        self._page_size = config.page_size
        self.agreed = AgreedBackups(
            tree,
            device_pool,
            host_pool,
            component_pools,
            allocator,
            copies,
            metrics,
            agreement,
            backup_limit=config.backup_queue_limit,
            store_limit=config.storage_write_queue_limit,
            write_through=False,
        )
        """The backups and write-through locks, begun and let go of where every rank is alike."""
        agreed = self.agreed

        # The queues carry what was begun at an engine call; what `close` drops unrun lets go of its
        # pages and locks as a copy that failed, or a write that ended, would.
        def drop_copies(batches: list[AgreedBackup]) -> None:
            for batch in batches:
                agreed.copied(batch, 0)

        def drop_stores(stores: list[AgreedStore]) -> None:
            for store in stores:
                agreed.stored(store)

        self.backups: WorkQueue[AgreedBackup] = WorkQueue(
            "backup", agreed.copy, limit=config.backup_queue_limit, max_batch=_MAX_BATCH, on_drop=drop_copies
        )
        self.storage_writes: WorkQueue[AgreedStore] = WorkQueue(
            "storage write-through",
            self._store,
            limit=config.storage_write_queue_limit,
            max_batch=_MAX_BATCH,
            on_drop=drop_stores,
        )
        agreed.queue_copy = lambda batch: not self.backups.put([batch])
        agreed.queue_store = lambda store: not self.storage_writes.put([store])
        self._writer: StorageWriter | None = None

    @property
    def writer(self) -> StorageWriter | None:
        """The host -> storage writer (set once the storage tier is open)."""
        return self._writer

    @writer.setter
    def writer(self, writer: StorageWriter | None) -> None:
        self._writer = writer
        self.agreed.write_through = writer is not None and self._config.backup_to_storage

    # ------------------------------------------------------------------ device allocation

    async def alloc_device(self, num_tokens: int) -> torch.Tensor | None:
        """Allocate device pages for `num_tokens` (checked by the caller), evicting as needed; None when
        not enough can be evicted. See `HiCache.alloc_device`.

        Each round agrees, in one step, the most device tokens any rank lacks and the least host room
        any rank has, whatever this rank's pool holds: every rank then evicts the same from its identical
        tree and all allocate, or all get None (pools may differ in size). For one rank the decisions
        resolve at once; the host room is worked out only when device pages are short there.
        """
        offer_host = True
        agreement = self._agreement
        agreed_need: int | None = None  # what the last round's eviction freed on every rank, if enough
        while True:
            free = self._device_pool.free_tokens
            if agreed_need is not None:
                need = 0  # the eviction freed what the neediest rank lacked: no round to agree again
            else:
                need_decision = agreement.propose("device_need", "")
                need_decision.settle(encode_max(max(0, num_tokens - free)))
                # Worked out where device pages are short, or where a peer may be short: the room is
                # the least over the ranks, and one rank not short needs none.
                short = num_tokens > free or not agreement.local
                room = await agreement.agree_value(
                    "host_room", self._allocator.host_room() if offer_host and short else 0
                )
                need = decode_max(await agreement.agree(need_decision))  # resolved in that step
            if not need:  # every rank has the room (and it only grew since it said so)
                indices = self._device_pool.alloc(num_tokens)
                if indices is None:
                    raise AssertionError(f"alloc_device: agreed room for {num_tokens} tokens is gone")
                return indices
            # The tree plans (demote, delete, back up or drop); this loop carries the plan out.
            result = self._tree.evict_device(need, host_free_tokens=room)
            self._device_pool.free(result.freed_device, owner=Owner.TREE)
            self._allocator.free_components(result.component_frees)
            if result.freed_host.numel():
                self._host_pool.free(result.freed_host, owner=Owner.TREE)
            if result.dropped_tokens:
                self._metrics.evict_dropped_tokens.inc(result.dropped_tokens)
            # Root-first chains, each below the earlier ones: one batch begins them in order, so
            # `backup_chain` finds exactly the planned chains (an earlier chain's nodes are pending).
            backed_up = await self.back_up(result.backup_first) if result.backups else 0
            if not result.backups and result.freed_device.numel() >= need:
                # A fact of the identical trees, with no await since: every rank has its room now.
                agreed_need = need
            if result.freed_device.numel() or backed_up:
                continue
            if not result.backups:
                if self.agreed.begun:
                    # Backups begun at an engine call hold their nodes (pending, device-locked) until
                    # they resolve: let them, here (alike on every rank: the begun batches are), and
                    # plan again, so that room that will exist is not refused.
                    await self.agreed.resolve_begun()
                    continue
                return None  # nothing could be evicted, nor backed up to make it evictable
            # The planned backups found no host room after all (taken meanwhile by other work): plan
            # again without host room, so that un-backed leaves are dropped instead of waited on.
            offer_host = False

    # ------------------------------------------------------------------ device -> host

    async def give_workers_a_turn(self) -> None:
        """Backpressure on the serving loop: yield to the backup and storage-write workers when they have
        work, and wait (bounded) for a queue above half its limit."""
        if self.backups.idle and self.storage_writes.idle:
            return
        await asyncio.sleep(0)
        for queue in (self.backups, self.storage_writes):
            watermark = (queue.limit or 0) // 2
            if queue.limit is not None and len(queue) > watermark:
                async with StopScope(_BACKPRESSURE_WAIT_S):
                    await queue.wait_below(watermark)

    async def start_backups(self, targets: Sequence[NodeRef]) -> None:
        """Back `targets` up in the background: begun here (at an engine call, on every rank alike),
        copied by the backup worker, and committed at the agreement that resolves the copies (for one
        rank: as soon as the copy landed)."""
        if targets:
            self.agreed.start(await self.agreed.begin(targets))

    async def back_up(self, targets: Sequence[NodeRef]) -> int:
        """Back `targets` up to host within this call, each with its un-backed ancestors, root first, in
        one device->host copy; returns how many targets were committed (0 on every rank, or the same).
        See `AgreedBackups.back_up_now`."""
        return await self.agreed.back_up_now(targets)

    # ------------------------------------------------------------------ host -> storage

    def _shed(self, count: int, tier: Tier, reason: ShedReason) -> None:
        self._metrics.writes_shed.inc(count, tier=tier.value, reason=reason.value)

    async def _store(self, stores: list[AgreedStore]) -> None:
        """Write `stores` (host-locked at the step that committed them, until every rank wrote) in one
        `store_many`; shed, and counted, while storage is down."""
        targets = [target for store in stores for target in store.targets]

        def done() -> None:
            for store in stores:
                self.agreed.stored(store)

        if self.writer is None or not self._breaker.allows():
            self._shed(len(targets), Tier.STORAGE, ShedReason.STORAGE_UNAVAILABLE)
            done()
            return
        try:
            await self.writer.store_many(targets, on_done=done)
        except StorageCircuitOpen:
            self._shed(len(targets), Tier.STORAGE, ShedReason.STORAGE_UNAVAILABLE)
        except OSError as exc:  # counted by the guard (`storage_errors`) and the writer; no traceback
            logger.warning("storage write-through of %d node(s) failed: %r", len(targets), exc)

    # ------------------------------------------------------------------ host -> device

    async def load_back(self, match: MatchResult) -> MatchResult:
        """Copy the host-only part of a match back to device and return the fresh match (unchanged when
        device memory cannot be found)."""
        if match.host_len == 0:
            return match
        tree = self._tree
        key = match.key
        start, length = match.device_len, match.host_len
        last_host = match.host_nodes[-1]
        tree.lock_device(match.last_device_node)
        tree.lock_host(last_host)
        try:
            host_values = match.host_indices
            device_indices = await self.alloc_device(length)
            if device_indices is None:
                # No room: the device part alone, cut back to where every component is valid.
                return tree.match_prefix(key[: start * TOKEN_BYTES]) if self._components else match
            self._device_pool.set_owner(device_indices, Owner.COPY)
            self._copies.track_load(self._device_pool, device_indices)
            loaded: _ComponentCopies = {}
            agreed = None
            try:
                # Component slots first (agreed under tensor parallelism): every rank takes them, the
                # same ones, before any copy can fail on one rank and end its call early.
                if self._components:
                    loaded = await self._alloc_components(match.host_nodes)
                # The load-back counts only if it succeeded on every rank.
                agreed = self._agreement.propose("load_back", "")
                await self._copies.copy(self._host_pool, host_values, self._device_pool, device_indices)
                for (_, name), (host, device) in loaded.items():
                    pools = self._component_pools[name]
                    await self._copies.copy(pools.host, host, pools.device, device)
            except BaseException:
                if agreed is not None:
                    agreed.settle(0)
                self._device_pool.free(device_indices, owner=Owner.COPY)
                self._free_loaded(loaded)
                raise
            finally:
                self._copies.untrack_load(device_indices)
                for _, device in loaded.values():
                    self._copies.untrack_load(device)
            assert agreed is not None
            agreed.settle(1)
            if not await self._agreement.agree(agreed):  # failed on another rank: keep the device part
                self._device_pool.free(device_indices, owner=Owner.COPY)
                self._free_loaded(loaded)
                return tree.match_prefix(key[: start * TOKEN_BYTES])
            # The copies are the tree's now; it hands back those no node takes (the tree may have changed
            # while the copy ran: splits, a concurrent load of the same nodes).
            self._device_pool.set_owner(device_indices, Owner.TREE)
            for (_, name), (_, device) in loaded.items():
                self._component_pools[name].device.set_owner(device, Owner.TREE)
            attached = tree.attach_loaded(key, start, device_indices, loaded)
            if attached.freed_device.numel():
                self._device_pool.free(attached.freed_device, owner=Owner.TREE)
            self._allocator.free_components(attached.component_frees)
            self._metrics.load_back_tokens.inc(length)
        finally:
            tree.unlock_host(last_host)
            tree.unlock_device(match.last_device_node)
        return attached.match

    async def _alloc_components(self, nodes: Sequence[NodeRef]) -> _ComponentCopies:
        """Fresh device slots for the host component values of `nodes`: (node, name) -> (host, device),
        tracked as loads in flight. A component whose device slots cannot be had is not loaded (its
        nodes stay tombstones there); under tensor parallelism on every rank alike (one agreed step)."""
        wanted: list[tuple[NodeRef, str, torch.Tensor]] = []
        for node in nodes:
            for comp in self._components:
                host = self._tree.component_value(node, comp.name, Tier.HOST)
                if host is not None:
                    wanted.append((node, comp.name, host))
        got = await self._allocator.take_component_slots(
            [(name, Tier.DEVICE, int(host.numel())) for _, name, host in wanted],
            owner=Owner.COPY,
            key="load_back",
        )
        loaded: _ComponentCopies = {}
        for (node, name, host), device in zip(wanted, got, strict=True):
            if device is not None:
                loaded[(node, name)] = (host, device)
                self._copies.track_load(self._component_pools[name].device, device)
        return loaded

    def _free_loaded(self, loaded: _ComponentCopies) -> None:
        """Give back the device slots of component loads that will not land."""
        for (_, name), (_, device) in loaded.items():
            self._component_pools[name].device.free(device, owner=Owner.COPY)
