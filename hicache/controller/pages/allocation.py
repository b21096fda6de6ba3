"""Allocation of device, host and component pages, evicting what the tree lets go of when a pool is full."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from hicache.components import Component
from hicache.config import HiCacheConfig
from hicache.controller.pages.release import ReleaseQueue
from hicache.memory import KVPool, Owner, make_device_pool, make_host_pool
from hicache.parallel.agreement import Agreement, decode_max, encode_max
from hicache.tiers import Tier
from hicache.tree import ComponentFree, RadixTree

__all__ = ["Allocator", "CachePools", "ComponentPools", "make_pools"]


class ComponentPools(NamedTuple):
    """A hybrid component's two pools."""

    device: KVPool
    """Its device slots: what the model reads and writes."""
    host: KVPool
    """Its host slots: backups and prefetched pages."""

    def on(self, tier: str) -> KVPool:
        """The pool of `tier` (`Tier.DEVICE` or `Tier.HOST`)."""
        return self.device if tier == Tier.DEVICE else self.host


class Allocator:
    """Takes pages from the device, host and component pools, evicting from the tree when one is short.

    Synchronous but for `take_component_slots` (one agreement step under tensor parallelism): what it
    evicts and allocates is consistent with the tree when the caller next awaits. (Device allocation,
    which may have to back evicted nodes up to host first, is the `TierMover`'s.)

    `agreement`: the ranks' agreement (component slots are taken with agreed evictions,
    `take_component_slots`; for one rank its decisions resolve at once).
    """

    def __init__(
        self,
        tree: RadixTree,
        device_pool: KVPool,
        host_pool: KVPool,
        component_pools: Mapping[str, ComponentPools],
        release_queue: ReleaseQueue,
        *,
        agreement: Agreement,
    ) -> None:
        self._tree = tree
        self._device_pool = device_pool
        self._host_pool = host_pool
        self._component_pools = component_pools
        self._release_queue = release_queue
        self._page_size = host_pool.page_size
        self._agreement = agreement

    @property
    def host_pool(self) -> KVPool:
        """The host pool it takes pages from (where a prefetch's pages go)."""
        return self._host_pool

    @property
    def component_pools(self) -> Mapping[str, ComponentPools]:
        """The hybrid components' pools it takes slots from, by name."""
        return self._component_pools

    @property
    def release_queue(self) -> ReleaseQueue:
        """Where released host pages and component slots wait to be freed (flushed when a pool is short)."""
        return self._release_queue

    def free_components(self, frees: Sequence[ComponentFree], owner: Owner = Owner.TREE) -> None:
        """Return the component indices a tree operation's result says it let go of to their pools (the
        tree's; an aborted backup's are a copy's)."""
        for free in frees:
            self._component_pools[free.component].on(free.tier).free(free.indices, owner=owner)

    def alloc_component_slots(
        self, name: str, tier: str, num_slots: int, *, owner: Owner
    ) -> torch.Tensor | None:
        """Allocate slots of a component's pool on `tier` for `owner`, evicting that component's values if
        needed; None when not enough can be evicted."""
        pool = self._component_pools[name].on(tier)
        indices = pool.alloc(num_slots, owner)
        if indices is not None:
            return indices
        if tier == Tier.HOST:
            self._release_queue.flush()
        free = pool.free_tokens
        if free < num_slots:
            self.free_components(self._tree.evict_component(name, num_slots - free, tier).component_frees)
        return pool.alloc(num_slots, owner)

    def free_component_slots(self, name: str, tier: str) -> int:
        """Slots of component `name`'s pool on `tier` free now (the release queue flushed first on host)."""
        pool = self._component_pools[name].on(tier)
        if tier == Tier.HOST:
            self._release_queue.flush()
        return pool.free_tokens

    def alloc_component_free(
        self, name: str, tier: str, num_slots: int, *, owner: Owner
    ) -> torch.Tensor | None:
        """Slots of a component's pool on `tier` from what is free, evicting nothing; None if short."""
        pool = self._component_pools[name].on(tier)
        if tier == Tier.HOST:
            self._release_queue.flush()
        return pool.alloc(num_slots, owner)

    def evict_component_slots(self, name: str, tier: str, num_slots: int) -> bool:
        """Evict `num_slots` slots of component `name` on `tier` from the tree and free what it lets go of;
        whether it freed that many (a fact of the tree: the same on every tensor-parallel rank)."""
        if num_slots <= 0:
            return True
        result = self._tree.evict_component(name, num_slots, tier)
        self.free_components(result.component_frees)
        return result.evicted_slots >= num_slots

    async def take_component_slots(
        self, wants: Sequence[tuple[str, str, int]], *, owner: Owner, key: str = ""
    ) -> list[torch.Tensor | None]:
        """`alloc_component_slots` for each (name, tier, slots) of `wants`, at a point every rank reaches
        alike (an engine call). Under tensor parallelism the evictions are agreed in one step for all of
        them (per component and tier, the most slots any rank lacks) and every rank evicts that from its
        identical tree: for each component and tier all ranks get their slots, or all get None (the tree
        could not evict that much). With one rank the decisions resolve at once, with no step."""
        agreement = self._agreement
        totals: dict[tuple[str, str], int] = {}
        for name, tier, n in wants:  # in the order of `wants`: the same on every rank
            totals[(name, tier)] = totals.get((name, tier), 0) + n
        rooms = []
        for (name, tier), total in totals.items():
            room = agreement.propose("component_room", f"{name}:{tier}:{key}")
            room.settle(encode_max(max(0, total - self.free_component_slots(name, tier))))
            rooms.append(((name, tier), room))
        needs = {where: decode_max(await agreement.agree(room)) for where, room in rooms}  # one step
        room_made = {
            (name, tier): self.evict_component_slots(name, tier, need) for (name, tier), need in needs.items()
        }
        # Free slots only grew since this rank said what it lacks (nothing takes component slots off
        # the engine path under tensor parallelism): with the agreed eviction they cover the request.
        out: list[torch.Tensor | None] = []
        for name, tier, n in wants:
            indices = (
                self.alloc_component_free(name, tier, n, owner=owner) if room_made[(name, tier)] else None
            )
            if room_made[(name, tier)] and indices is None:
                raise AssertionError(f"take_component_slots: agreed room for {n} {name} slots is gone")
            out.append(indices)
        return out

    def host_room(self) -> int:
        """Host tokens a backup can have now: free pages plus what `evict_host` can really reclaim (host
        copies of host-only nodes without a host or device lock; never a device node's copy, a locked
        one, or an ancestor of a node on the device)."""
        self._release_queue.flush()
        free = self._host_pool.free_tokens
        return free + self._tree.reclaimable_host_size()

    def alloc_host(self, num_tokens: int, *, owner: Owner, partial: bool = False) -> torch.Tensor | None:
        """Allocate host pages for `owner`, evicting host-only leaves if needed; `partial` takes what can
        be had."""
        pool = self._host_pool
        indices = pool.alloc(num_tokens, owner)
        if indices is not None:
            return indices
        self._release_queue.flush()
        free = pool.free_tokens
        if free < num_tokens:
            evicted = self._tree.evict_host(num_tokens - free)
            if evicted.freed_host.numel():
                pool.free(evicted.freed_host, owner=Owner.TREE)
            self.free_components(evicted.component_frees)
        indices = pool.alloc(num_tokens, owner)
        if indices is None and partial:
            free = pool.free_tokens
            indices = pool.alloc(free, owner) if free > 0 else None
        return indices

    def free_host_tokens(self) -> int:
        """Host tokens free now (the release queue flushed first)."""
        self._release_queue.flush()
        return self._host_pool.free_tokens

    def evict_host(self, num_tokens: int) -> int:
        """Evict `num_tokens` host tokens of host-only leaves and free them; returns the tokens freed."""
        evicted = self._tree.evict_host(num_tokens)
        if evicted.freed_host.numel():
            self._host_pool.free(evicted.freed_host, owner=Owner.TREE)
        self.free_components(evicted.component_frees)
        return int(evicted.freed_host.numel())

    def alloc_host_free(self, num_tokens: int, *, owner: Owner) -> torch.Tensor:
        """Up to `num_tokens` host tokens (whole pages) from what is free, evicting nothing (maybe none)."""
        free = self.free_host_tokens()
        indices = self._host_pool.alloc(min(num_tokens, free), owner) if min(num_tokens, free) > 0 else None
        return indices if indices is not None else torch.empty(0, dtype=torch.int64)

    def caller_claims(
        self,
        device_indices: torch.Tensor | npt.NDArray[np.int64] | None,
        components: Mapping[str, torch.Tensor] | None,
    ) -> list[tuple[KVPool, torch.Tensor]]:
        """Check that `device_indices` and `components` are pages the caller holds (from `alloc_device`,
        `alloc_component`, not inserted, no page twice); return them with their pools. Changes nothing.
        """
        out: list[tuple[KVPool, torch.Tensor]] = []
        if device_indices is not None:
            self._device_pool.check_owned(device_indices, Owner.LEASE, name="device_indices")
            if isinstance(device_indices, torch.Tensor):  # `insert` checks a numpy view and frees nothing
                out.append((self._device_pool, device_indices))
        if components:
            if not isinstance(components, Mapping):
                raise TypeError(f"components: expected a mapping of name to indices, got {components!r:.80}")
            for name, indices in components.items():
                if name not in self._component_pools:
                    raise ValueError(f"components: unknown component {name!r}")
                pool = self._component_pools[name].device
                pool.check_owned(indices, Owner.LEASE, name=f"components[{name!r}]")
                out.append((pool, indices))
        return out


class CachePools(NamedTuple):
    """The pools of a cache, and which of them it made (and so closes)."""

    device: KVPool
    host: KVPool
    components: dict[str, ComponentPools]
    owned: list[KVPool]


def make_pools(
    config: HiCacheConfig,
    components: Sequence[Component],
    device_pool: KVPool | None,
    host_pool: KVPool | None,
) -> CachePools:
    """Make the pools a cache needs and was not given (the caller's must match `config.layout`).

    If making one fails, those already made are closed before the error propagates.

    Raises:
        ValueError: naming `device_pool` or `host_pool` when its layout is not `config.layout`.
    """
    for name, pool in (("device_pool", device_pool), ("host_pool", host_pool)):
        if pool is not None and pool.layout != config.layout:
            raise ValueError(f"{name}: layout {pool.layout} does not match config.layout {config.layout}")
    owned: list[KVPool] = []

    def own(pool: KVPool) -> KVPool:
        owned.append(pool)
        return pool

    try:
        component_pools: dict[str, ComponentPools] = {}
        for comp in components:
            layout = comp.pool_layout(config.page_size)
            component_pools[comp.name] = ComponentPools(
                own(make_device_pool(layout, comp.device_pages, name=f"{comp.name}-device")),
                own(make_host_pool(layout, comp.host_pages, name=f"{comp.name}-host")),
            )
        device = (
            device_pool
            if device_pool is not None
            else own(make_device_pool(config.layout, config.device_pages))
        )
        host = host_pool if host_pool is not None else own(make_host_pool(config.layout, config.host_pages))
    except BaseException:
        for made in owned:
            made.close()
        raise
    return CachePools(device, host, component_pools, owned)
