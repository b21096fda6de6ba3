"""Moving pages between tiers: device -> host backups (and the device eviction that needs them), host ->
storage write-through, and host -> device load-back."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from functools import partial

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
from hicache.tree import ComponentFree, MatchResult, NodeRef, RadixTree
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
        agreement: the ranks' agreement (for one rank its decisions resolve at once): device allocation
            and load-backs are agreed with it; across several ranks backups and write-through locks
            too (`AgreedBackups`).
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
        # Under tensor parallelism the queues carry agreed batches (begun at an engine call) instead.
        self.backups: WorkQueue[NodeRef | AgreedBackup] = WorkQueue(
            "backup", self._backup_batch, limit=config.backup_queue_limit, max_batch=_MAX_BATCH
        )
        self.storage_writes: WorkQueue[NodeRef | AgreedStore] = WorkQueue(
            "storage write-through",
            self._store,
            limit=config.storage_write_queue_limit,
            max_batch=_MAX_BATCH,
            on_drop=lambda items: _unlock_all(tree, [t for t in items if not isinstance(t, AgreedStore)]),
        )
        self._writer: StorageWriter | None = None
        self._backup_lock = asyncio.Lock()
        self.agreed: AgreedBackups | None = None
        """Under tensor parallelism: the backups and write-through locks the ranks agree on."""
        if not agreement.local:
            agreed = AgreedBackups(
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
            agreed.queue_copy = lambda batch: not self.backups.put([batch])
            agreed.queue_store = lambda store: not self.storage_writes.put([store])
            self.agreed = agreed

    @property
    def writer(self) -> StorageWriter | None:
        """The host -> storage writer (set once the storage tier is open)."""
        return self._writer

    @writer.setter
    def writer(self, writer: StorageWriter | None) -> None:
        self._writer = writer
        if self.agreed is not None:
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
            free = self._device_pool.statistics().free_pages * self._page_size
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

    def schedule_backups(self, targets: Sequence[NodeRef]) -> None:
        """Queue backups of `targets` (shedding, and counting, what the queue cannot take)."""
        shed = self.backups.put(targets)
        if shed:
            self._shed(len(shed), Tier.HOST, ShedReason.QUEUE_FULL)

    async def start_backups(self, targets: Sequence[NodeRef]) -> None:
        """Back `targets` up in the background: queued on one rank (`schedule_backups`); under tensor
        parallelism begun here, on every rank alike, and committed at the step that agrees them."""
        if self.agreed is None:
            self.schedule_backups(targets)
        elif targets:
            self.agreed.start(await self.agreed.begin(targets))

    async def _backup_batch(self, items: list[NodeRef | AgreedBackup]) -> None:
        batches = [item for item in items if isinstance(item, AgreedBackup)]
        targets = [item for item in items if not isinstance(item, AgreedBackup)]
        if batches:
            assert self.agreed is not None
            await self.agreed.copy(batches)
        if targets:
            await self.back_up(targets)

    async def back_up(self, targets: Sequence[NodeRef]) -> int:
        """Back `targets` up to host, each with its un-backed ancestors, root first, in one device->host
        copy (one thread hop however many requests queued backups meanwhile). Returns how many targets
        were committed (those backed up already, pending or without host room are not). Under tensor
        parallelism the backup is begun, copied and agreed within this call (`AgreedBackups`)."""
        if self.agreed is not None:
            return await self.agreed.back_up_now(targets)
        async with self._backup_lock:
            chains: list[tuple[NodeRef, list[NodeRef]]] = []
            nodes: list[NodeRef] = []
            device_parts: list[torch.Tensor] = []
            host_parts: list[torch.Tensor] = []
            comp_copies: _ComponentCopies = {}
            try:
                for target in targets:
                    # Computed after the earlier chains began: a shared ancestor is pending by now and
                    # ends this chain, so every node is copied once and committed after its parent.
                    chain = self._tree.backup_chain(target)
                    if not chain:
                        continue
                    infos = [self._tree.node_info(node) for node in chain]
                    sizes = [info.num_tokens for info in infos]
                    host_indices = self._allocator.alloc_host(sum(sizes), owner=Owner.COPY)
                    if host_indices is None:
                        self._metrics.backup_skipped.inc()
                        continue
                    staged_comps = self._stage_component_backup(chain) if self._components else {}
                    comp_copies.update(staged_comps)
                    offset = 0
                    for node, info in zip(chain, infos, strict=True):
                        size = info.num_tokens
                        staged = {name: host for (n, name), (_, host) in staged_comps.items() if n == node}
                        self._tree.begin_backup(node, host_indices[offset : offset + size], staged or None)
                        nodes.append(node)
                        assert info.device_value is not None
                        device_parts.append(info.device_value)
                        offset += size
                    host_parts.append(host_indices)
                    chains.append((target, chain))
                if not chains:
                    return 0
                await self._copies.copy(
                    self._device_pool, torch.cat(device_parts), self._host_pool, torch.cat(host_parts)
                )
                for (_, name), (device, host) in comp_copies.items():
                    pools = self._component_pools[name]
                    await self._copies.copy(pools.device, device, pools.host, host)
            except BaseException:
                for node in reversed(nodes):
                    aborted = self._tree.abort_backup(node)
                    self._host_pool.free(aborted.freed_host, owner=Owner.COPY)
                    self._allocator.free_components(aborted.component_frees, owner=Owner.COPY)
                raise
            # Root first. A node split while copying is committed together with its split-off upper part.
            frees: list[ComponentFree] = []
            for node in nodes:
                frees.extend(self._tree.commit_backup(node).component_frees)
            # The host copies now belong to the tree (before freeing what it let go of among them).
            for part in host_parts:
                self._host_pool.set_owner(part, Owner.TREE)
            for (_, name), (_, host) in comp_copies.items():
                self._component_pools[name].host.set_owner(host, Owner.TREE)
            self._allocator.free_components(frees)
            self._metrics.backup_tokens.inc(sum(int(part.numel()) for part in host_parts))
        if self.writer is not None and self._config.backup_to_storage:
            self._queue_storage_writes([target for target, _ in chains])
        return len(chains)

    def _stage_component_backup(self, chain: Sequence[NodeRef]) -> _ComponentCopies:
        """Host slots for the component device values of `chain`: (node, name) -> (device, host).

        A component whose host slots cannot be had is not backed up (the node is a tombstone there).
        """
        out: _ComponentCopies = {}
        for node in chain:
            for comp in self._components:
                device = self._tree.component_value(node, comp.name, Tier.DEVICE)
                if device is None:
                    continue
                host = self._allocator.alloc_component_slots(
                    comp.name, Tier.HOST, int(device.numel()), owner=Owner.COPY
                )
                if host is not None:
                    out[(node, comp.name)] = (device, host)
        return out

    # ------------------------------------------------------------------ host -> storage

    def _shed(self, count: int, tier: Tier, reason: ShedReason) -> None:
        self._metrics.writes_shed.inc(count, tier=tier.value, reason=reason.value)

    def _queue_storage_writes(self, targets: list[NodeRef]) -> None:
        """Queue write-through of `targets`, each host-locked until it is written (host eviction never
        takes a queued write's pages); shed (and count) what the queue refuses, and all while storage is
        down. Admission is the only place a write is shed."""
        if not self._breaker.allows():
            self._shed(len(targets), Tier.STORAGE, ShedReason.STORAGE_UNAVAILABLE)
            return
        for target in targets:
            self._tree.lock_host(target)
        shed = self.storage_writes.put(targets)
        queued = len(targets) - len(shed)
        if not self.storage_writes.accepting:  # closing: nothing was queued, nothing is shed
            queued = 0
        elif shed:
            self._shed(len(shed), Tier.STORAGE, ShedReason.QUEUE_FULL)
        _unlock_all(self._tree, targets[queued:])

    async def _store(self, items: list[NodeRef | AgreedStore]) -> None:
        targets = [item for item in items if not isinstance(item, AgreedStore)]
        for item in items:
            if isinstance(item, AgreedStore):
                await self._store_agreed(item)
        if targets:
            await self._store_targets(targets)

    async def _store_agreed(self, store: AgreedStore) -> None:
        """Write an agreed write-through (its targets are host-locked until every rank's write is done)."""
        assert self.agreed is not None
        done = partial(self.agreed.stored, store)
        if self.writer is None or not self._breaker.allows():
            self._shed(len(store.targets), Tier.STORAGE, ShedReason.STORAGE_UNAVAILABLE)
            done()
            return
        try:
            await self.writer.store_many(store.targets, on_done=done)
        except StorageCircuitOpen:
            self._shed(len(store.targets), Tier.STORAGE, ShedReason.STORAGE_UNAVAILABLE)
        except OSError as exc:  # counted by the guard (`storage_errors`) and the writer; no traceback
            logger.warning("storage write-through of %d node(s) failed: %r", len(store.targets), exc)

    async def _store_targets(self, targets: list[NodeRef]) -> None:
        """Write queued `targets` (host-locked since they were queued; let go of once written)."""
        done = partial(_unlock_all, self._tree, targets)
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


def _unlock_all(tree: RadixTree, nodes: Sequence[NodeRef]) -> None:
    for node in nodes:
        tree.unlock_host(node)
