"""Backups and write-through, for one rank and N alike: every change they make to the tree is agreed.

The backup worker's pace is rank-local, so if it began and committed backups whenever it ran, the ranks'
trees would differ between quiescent points (a node backed up on one rank and not yet on another,
device-locked by a copy on one rank only), and so would what eviction then picks. Here, on any number of
ranks (one rank is an agreement of one: its decisions resolve as they are settled, with no step):

- A backup *begins* inside the engine call that asks for it (`insert`, a device eviction), on every rank
  alike: the host room is agreed first (the most any rank must evict, `backup_room`), every rank evicts
  that much host memory (the same nodes: the trees are identical) and takes its pages, the nodes are
  marked pending, and one `backup` decision is proposed for the batch.
- The copy runs in the background and settles the decision with this rank's outcome (1 copied, 0 failed).
- The step that resolves the decision commits the batch on every rank (the agreed minimum is 1) or aborts
  it on every rank, releasing the host pages (some rank's copy failed); a chain whose parent's backup was
  aborted meanwhile is aborted too. Same step, same order, every rank.
- Write-through to storage host-locks the committed paths in that same step and proposes one `store`
  decision; the write runs in the background, and the step resolving the decision lets go of the locks
  on every rank. So host eviction only ever sees backed-up flags and host locks the ranks agree on.

Shedding (too many backups or writes in flight) counts pending decisions, which change only at engine
calls and resolving steps, so every rank sheds the same targets.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum

import torch

from hicache.controller.movement.copies import CopyTracker
from hicache.controller.pages.allocation import Allocator, ComponentPools
from hicache.memory import KVPool, Owner
from hicache.metrics import CacheMetrics
from hicache.parallel.agreement import Agreement, Decision, decode_max, encode_max
from hicache.policy import WritePolicy
from hicache.tiers import ShedReason, Tier
from hicache.tree import ComponentFree, NodeRef, RadixTree

__all__ = ["AgreedBackup", "AgreedBackups", "AgreedStore", "BackupState", "StoreState"]

logger = logging.getLogger("hicache.cache")


class BackupState(Enum):
    """Where an `AgreedBackup` batch is in its life: its copy on this rank, then the ranks' verdict."""

    QUEUED = "queued"
    """Begun on every rank (host pages taken, nodes pending); this rank's copy has not started."""
    COPYING = "copying"
    """This rank's copy runs."""
    COPIED = "copied"
    """This rank's copy landed (its decision settled with 1); the ranks' verdict is pending."""
    COPY_FAILED = "copy failed"
    """This rank's copy failed or was not run (settled with 0); the verdict, an abort, is pending."""
    COMMITTED = "committed"
    """Agreed 1: each chain whose parent is backed up was committed, the others aborted."""
    ABORTED = "aborted"
    """Agreed 0, or the agreement failed: every chain was aborted and its host pages freed."""


_NEXT_STATES: dict[BackupState, frozenset[BackupState]] = {
    BackupState.QUEUED: frozenset({BackupState.COPYING, BackupState.COPY_FAILED, BackupState.ABORTED}),
    BackupState.COPYING: frozenset({BackupState.COPIED, BackupState.COPY_FAILED}),
    BackupState.COPIED: frozenset({BackupState.COMMITTED, BackupState.ABORTED}),
    BackupState.COPY_FAILED: frozenset({BackupState.ABORTED}),  # the verdict is the ranks' minimum
    BackupState.COMMITTED: frozenset(),
    BackupState.ABORTED: frozenset(),
}


@dataclass(eq=False)
class AgreedBackup:
    """One batch of backups begun at one engine call: root-first chains, one host range, one decision."""

    targets: list[NodeRef]
    chains: list[list[NodeRef]]
    device: torch.Tensor
    host: torch.Tensor
    chain_hosts: list[torch.Tensor]
    """Each chain's part of `host` (sized when begun: a node may be split while it is copied)."""
    chain_components: list[list[tuple[str, torch.Tensor, torch.Tensor]]]
    """Per chain, the component values copied with it: (name, device slots, host slots), one per node
    and component backed up."""
    chain_parents: list[NodeRef | None] = field(default_factory=list)
    """Each chain's top's parent when begun (None: the root). A split of a pending node puts its upper
    part, pending in the same backup, between the two: the commit checks this parent, as the tree does."""
    decision: Decision | None = None
    state: BackupState = field(default=BackupState.QUEUED, init=False)

    def enter(self, state: BackupState) -> None:
        """Move to `state`, one of the states that may follow the current one."""
        assert state in _NEXT_STATES[self.state], f"an agreed backup cannot go {self.state} -> {state}"
        self.state = state

    @property
    def finished(self) -> bool:
        """Whether the batch was committed or aborted (its verdict is known)."""
        return self.state in (BackupState.COMMITTED, BackupState.ABORTED)

    @property
    def tokens(self) -> int:
        """Host tokens the batch copies into."""
        return int(self.host.numel())


class StoreState(Enum):
    """Where an `AgreedStore` is in its life, one state after the other."""

    WRITING = "writing"
    """Host-locked at an agreed step; this rank's write runs (or waits for the writer)."""
    WRITTEN = "written"
    """This rank's write is done and no thread reads the pages; the ranks' agreement is pending."""
    RELEASED = "released"
    """Every rank's write is done (or the agreement failed): the host locks were let go of."""


@dataclass(eq=False)
class AgreedStore:
    """Write-through of committed targets: host-locked at an agreed step, let go of at another."""

    targets: list[NodeRef]
    decision: Decision | None = None
    state: StoreState = field(default=StoreState.WRITING, init=False)


class AgreedBackups:
    """Begins, copies, commits and aborts device->host backups, and holds write-through host locks, at
    points every rank reaches alike (see the module docstring); the cache's only backup path.

    Args:
        tree: the radix tree.
        device_pool, host_pool: the pools copied between.
        component_pools: the hybrid components' pools, by name (their values are backed up with their
            nodes: the host slots to evict for them are agreed with the batch's host room).
        allocator: frees and takes host and component pages.
        copies: runs the device->host copies.
        metrics: the cache's metric set.
        agreement: the ranks' agreement (for one rank its decisions resolve as they are settled).
        backup_limit: most backup targets pending at once (beyond: shed, on every rank alike).
        store_limit: most write-through targets host-locked at once (beyond: shed, alike).
        write_through: whether committed backups are written to storage (`backup_to_storage`).
    """

    def __init__(
        self,
        tree: RadixTree,
        device_pool: KVPool,
        host_pool: KVPool,
        component_pools: Mapping[str, ComponentPools],
        allocator: Allocator,
        copies: CopyTracker,
        metrics: CacheMetrics,
        agreement: Agreement,
        *,
        backup_limit: int,
        store_limit: int,
        write_through: bool,
    ) -> None:
        self._tree = tree
        self._device_pool = device_pool
        self._host_pool = host_pool
        self._component_pools = component_pools
        self._allocator = allocator
        self._copies = copies
        self._metrics = metrics
        self._agreement = agreement
        self._backup_limit = backup_limit
        self._store_limit = store_limit
        self.write_through = write_through
        self.pending_targets = 0
        """Backup targets begun and not yet resolved (the same on every rank)."""
        self.storing_targets = 0
        """Write-through targets host-locked and not yet let go of (the same on every rank)."""
        self._begun: dict[AgreedBackup, None] = {}
        """The batches begun and not yet committed or aborted, in the order they were begun (a dict: a
        batch leaves it in O(1), whichever resolves first)."""
        self.queue_copy: Callable[[AgreedBackup], bool] = lambda batch: False
        """Hands a begun batch to the background copy worker; False if it was not taken."""
        self.queue_store: Callable[[AgreedStore], bool] = lambda store: False
        """Hands a write-through to the background writer; False if it was not taken."""

    # ------------------------------------------------------------------ beginning (engine calls)

    def _chains(self, targets: Sequence[NodeRef]) -> tuple[list[NodeRef], list[list[NodeRef]], int]:
        """The targets kept (within the limit), their un-backed chains root-first (each node once) and
        their tokens; counts the shed ones."""
        kept: list[NodeRef] = []
        chains: list[list[NodeRef]] = []
        seen: set[NodeRef] = set()
        tokens = 0
        shed = 0
        for target in targets:
            chain = [node for node in self._tree.backup_chain(target) if node not in seen]
            if not chain:
                continue
            if self.pending_targets + len(kept) >= self._backup_limit:
                shed += 1
                continue
            seen.update(chain)
            kept.append(target)
            chains.append(chain)
            tokens += sum(self._tree.node_size(node) for node in chain)
        if shed:
            self._metrics.writes_shed.inc(shed, tier=Tier.HOST.value, reason=ShedReason.QUEUE_FULL.value)
        return kept, chains, tokens

    async def begin(self, targets: Sequence[NodeRef]) -> AgreedBackup | None:
        """Begin backing `targets` up (each with its un-backed ancestors) on every rank alike; None when
        there is nothing to back up or no host room on some rank (then on every rank).

        Every rank calls it with the same targets at the same point (an engine call). One agreement step
        (the host room) when there is something to back up; none otherwise.
        """
        kept, chains, tokens = self._chains(targets)
        if not tokens:
            return None
        deficit = max(0, tokens - self._allocator.free_host_tokens())
        # Each component's host slots to evict ride on the same step (the most any rank lacks).
        slots = self._component_slots(chains)
        rooms = [(name, self._agreement.propose("backup_component_room", name)) for name in sorted(slots)]
        for name, room in rooms:
            room.settle(
                encode_max(max(0, slots[name] - self._allocator.free_component_slots(name, Tier.HOST)))
            )
        evict = await self._agreement.agree_max("backup_room", deficit)
        comp_evict = {name: decode_max(await self._agreement.agree(room)) for name, room in rooms}
        # The tree may have changed during the step (a backup resolved): plan again, alike everywhere.
        kept, chains, again = self._chains(kept)
        if not again:
            return None
        evict += max(0, again - tokens)
        if evict and self._allocator.evict_host(evict) < evict:
            # Some rank has no room for the whole batch: no rank backs it up. Its upper part may fit (a
            # shared prefix above the leaves): any leading run of its root-first nodes keeps every
            # parent ahead of its children, so begin again without the last nodes, as many as the
            # agreed deficit (alike on every rank: the trees are identical).
            self._metrics.backup_skipped.inc()
            upper = [node for chain in chains for node in chain]
            short = evict
            while upper and short > 0:
                short -= self._tree.node_size(upper.pop())
            return await self.begin(upper) if upper else None
        # A component whose host slots the tree could not free (on every rank alike) is not backed up
        # with this batch: its nodes are tombstones on host there, as on one rank.
        backed = {
            name: self._allocator.evict_component_slots(
                name, Tier.HOST, need + max(0, n - slots.get(name, 0))
            )
            for name, n in self._component_slots(chains).items()
            for need in [comp_evict.get(name, 0)]
        }
        # Free host pages only grew since this rank settled (nothing allocates host pages off the engine
        # path under tensor parallelism; one rank's step returned without yielding): with the agreed
        # eviction, they cover the batch.
        host = self._host_pool.alloc(again, Owner.COPY)
        if host is None:
            raise AssertionError(
                f"rank {self._agreement.tp_rank}: no host room for an agreed backup of {again} tokens"
            )
        device_parts: list[torch.Tensor] = []
        chain_hosts: list[torch.Tensor] = []
        chain_comps: list[list[tuple[str, torch.Tensor, torch.Tensor]]] = []
        offset = 0
        for chain in chains:
            start = offset
            comps: list[tuple[str, torch.Tensor, torch.Tensor]] = []
            chain_comps.append(comps)
            for node in chain:
                size = self._tree.node_size(node)
                device_value = self._tree.device_value(node)
                assert device_value is not None
                staged = self._stage_components(node, backed)
                comps.extend((name, device, slots) for name, (device, slots) in staged.items())
                staged_hosts = {name: slots for name, (_, slots) in staged.items()}
                self._tree.begin_backup(node, host[offset : offset + size], staged_hosts or None)
                device_parts.append(device_value)
                offset += size
            chain_hosts.append(host[start:offset])
        parents = [self._tree.parent_of(chain[0]) for chain in chains]
        batch = AgreedBackup(
            kept,
            chains,
            _joined(device_parts),
            host,
            chain_hosts,
            chain_comps,
            [None if parent == self._tree.root else parent for parent in parents],
        )
        self.pending_targets += len(kept)
        self._begun[batch] = None
        nodes = sum(len(chain) for chain in chains)
        batch.decision = self._agreement.propose(
            "backup", f"{nodes}:{again}", on_resolve=lambda agreed: self._resolved(batch, agreed)
        )
        return batch

    def _component_slots(self, chains: Sequence[Sequence[NodeRef]]) -> dict[str, int]:
        """Host slots each component's device values on `chains` need (components with none left out)."""
        out: dict[str, int] = {}
        for chain in chains:
            for node in chain:
                for comp in self._tree.components:
                    value = self._tree.component_value(node, comp.name, Tier.DEVICE)
                    if value is not None:
                        out[comp.name] = out.get(comp.name, 0) + int(value.numel())
        return out

    def _stage_components(
        self, node: NodeRef, backed: Mapping[str, bool]
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Host slots for `node`'s device component values that are backed up (`backed`): name ->
        (device, host). The agreed eviction made the room, so every slot is had on every rank."""
        out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for comp in self._tree.components:
            device = self._tree.component_value(node, comp.name, Tier.DEVICE)
            if device is None or not backed.get(comp.name, False):
                continue
            slots = self._allocator.alloc_component_free(
                comp.name, Tier.HOST, int(device.numel()), owner=Owner.COPY
            )
            if slots is None:
                raise AssertionError(
                    f"rank {self._agreement.tp_rank}: no {comp.name} host slots for an agreed backup"
                )
            out[comp.name] = (device, slots)
        return out

    async def back_up_now(self, targets: Sequence[NodeRef]) -> int:
        """Begin, copy and agree a backup within this engine call (a device eviction that needs the host
        copies before it can demote); returns the targets committed (0 on every rank, or the same)."""
        batch = await self.begin(targets)
        if batch is None:
            return 0
        assert batch.decision is not None

        async def copy() -> int:
            await self.copy([batch])
            # `copied` settled the decision already (the first value settled counts): this only says it.
            return int(batch.state in (BackupState.COPIED, BackupState.COMMITTED))

        await self._agreement.agree_on(batch.decision, copy, settles_early=True)
        return len(batch.targets) if batch.state is BackupState.COMMITTED else 0

    @property
    def begun(self) -> bool:
        """Whether some batch is begun and not yet committed or aborted (alike on every rank)."""
        return bool(self._begun)

    async def resolve_begun(self) -> None:
        """Copy (here, if the worker has not started it) and agree every batch begun so far, in the order
        begun: each is committed or aborted on return. Every rank calls it at the same point of an engine
        call (the begun batches are alike there), so all agree the same decisions in the same order; one
        rank's resolve as their copies land."""
        for batch in list(self._begun):
            if batch.finished:
                continue
            if batch.state is BackupState.QUEUED:
                await self.copy([batch])  # the worker skips it when it comes to it (no longer queued)
            assert batch.decision is not None
            await self._agreement.agree(batch.decision)

    def start(self, batch: AgreedBackup | None) -> None:
        """Hand a begun batch to the background copy (not taken: it counts as failed on this rank)."""
        if batch is not None and not self.queue_copy(batch):
            self.copied(batch, 0)

    # ------------------------------------------------------------------ copying (background)

    async def copy(self, batches: Sequence[AgreedBackup]) -> None:
        """Copy `batches` device->host in one copy and settle each one's decision with the outcome."""
        live = [b for b in batches if b.state is BackupState.QUEUED]
        if not live:
            return
        for b in live:
            b.enter(BackupState.COPYING)
        ok = 1
        try:
            await self._copies.copy(
                self._device_pool,
                _joined([b.device for b in live]),
                self._host_pool,
                _joined([b.host for b in live]),
            )
            for b in live:
                for comps in b.chain_components:
                    for name, device, host in comps:
                        pools = self._component_pools[name]
                        await self._copies.copy(pools.device, device, pools.host, host)
        except Exception as exc:
            logger.warning("backup copy of %d batch(es) failed on this rank: %r", len(live), exc)
            ok = 0
        except BaseException:
            for b in live:
                self.copied(b, 0)
            raise
        for b in live:
            self.copied(b, ok)

    def copied(self, batch: AgreedBackup, ok: int) -> None:
        """This rank's copy of `batch` ended (`ok` 1) or will not run (0): settle its decision."""
        if not batch.finished:  # a batch aborted before its copy started stays aborted
            batch.enter(BackupState.COPIED if ok else BackupState.COPY_FAILED)
        decision = batch.decision
        assert decision is not None
        if decision.resolved:  # the agreement failed meanwhile: abort now that no copy writes
            self._finish(batch, 0)
        else:
            decision.settle(ok)

    # ------------------------------------------------------------------ resolving (agreement steps)

    def _resolved(self, batch: AgreedBackup, agreed: int | None) -> None:
        if agreed is None and batch.state is BackupState.COPYING:
            return  # the agreement failed (closing): aborted once the copy returns (`copied`)
        self._finish(batch, agreed or 0)

    def _finish(self, batch: AgreedBackup, verdict: int) -> None:
        if batch.finished:
            return
        batch.enter(BackupState.COMMITTED if verdict else BackupState.ABORTED)
        self.pending_targets -= len(batch.targets)
        tree = self._tree
        committed: list[NodeRef] = []
        frees: list[ComponentFree] = []
        del self._begun[batch]
        for target, chain, parent, host, comps in zip(
            batch.targets,
            batch.chains,
            batch.chain_parents,
            batch.chain_hosts,
            batch.chain_components,
            strict=True,
        ):
            if verdict and self._parent_backed_up(parent):
                for node in chain:
                    frees.extend(tree.commit_backup(node).component_frees)
                # The host copies are the tree's now (before freeing what it let go of among them).
                for name, _, slots in comps:
                    self._component_pools[name].host.set_owner(slots, Owner.TREE)
                self._host_pool.set_owner(host, Owner.TREE)
                committed.append(target)
                self._metrics.backup_tokens.inc(int(host.numel()))
            else:
                for node in reversed(chain):
                    aborted = tree.abort_backup(node)
                    self._host_pool.free(aborted.freed_host, owner=Owner.COPY)
                    self._allocator.free_components(aborted.component_frees, owner=Owner.COPY)
        self._allocator.free_components(frees)
        if committed and self.write_through and self._agreement.failed is None:
            self._store(committed)

    def _parent_backed_up(self, parent: NodeRef | None) -> bool:
        """Whether a chain below `parent` (its top's parent when begun; None: the root) may commit: the
        parent is the root or backed up (an earlier batch the parent was pending in may have been
        aborted), or the policy is write-back. Not the top's parent now: a split of the pending top put
        its upper part, pending with it and committed with it, in between."""
        tree = self._tree
        if tree.write_policy is WritePolicy.WRITE_BACK:
            return True
        return parent is None or tree.is_backed_up(parent)

    def _store(self, targets: list[NodeRef]) -> None:
        """Host-lock `targets` for their write-through (at this agreed step) and propose its release."""
        room = self._store_limit - self.storing_targets
        if room < len(targets):
            shed = len(targets) - max(0, room)
            self._metrics.writes_shed.inc(shed, tier=Tier.STORAGE.value, reason=ShedReason.QUEUE_FULL.value)
            targets = targets[: max(0, room)]
        if not targets:
            return
        for target in targets:
            self._tree.lock_host(target)
        self.storing_targets += len(targets)
        store = AgreedStore(targets)
        store.decision = self._agreement.propose(
            "store", str(len(targets)), on_resolve=lambda agreed: self._store_resolved(store, agreed)
        )
        if not self.queue_store(store):
            self.stored(store)

    def _store_resolved(self, store: AgreedStore, agreed: int | None) -> None:
        if agreed is None and store.state is StoreState.WRITING:
            return  # the agreement failed (closing): let go once no thread reads the pages (`stored`)
        self._unlock(store)

    def _unlock(self, store: AgreedStore) -> None:
        """Every rank's write is done (or the agreement failed): let go of the host locks."""
        if store.state is StoreState.RELEASED:
            return
        store.state = StoreState.RELEASED
        self.storing_targets -= len(store.targets)
        for target in store.targets:
            self._tree.unlock_host(target)

    def stored(self, store: AgreedStore) -> None:
        """This rank's write of `store` is done and no thread reads its pages."""
        if store.state is StoreState.WRITING:
            store.state = StoreState.WRITTEN
        assert store.decision is not None
        if store.decision.resolved:  # the agreement failed meanwhile
            self._unlock(store)
        else:
            store.decision.settle(1)


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """`torch.cat(parts)`, without the op (~10 us on the loop) for one part, the usual batch."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)
