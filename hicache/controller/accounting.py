"""The ownership accounting check: every page of every pool has exactly one owner, and its tag says so."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from hicache.controller.movement.copies import CopyTracker
from hicache.controller.pages.allocation import ComponentPools
from hicache.controller.pages.release import ReleaseQueue
from hicache.controller.prefetch.job import Prefetch
from hicache.errors import InvariantViolation
from hicache.memory import KVPool, Owner
from hicache.tree import RadixTree

__all__ = ["Accounting"]


class Accounting:
    """Checks the tree's invariants and the page ownership of every pool (`HiCache.sanity_check`).

    Args:
        tree: the radix tree.
        device_pool, host_pool, component_pools: the pools to account for.
        release_queue: pages pending release (and quarantined).
        copies: the load-backs in flight.
        prefetches: returns every prefetch that still holds pages (in flight or detached).
    """

    def __init__(
        self,
        tree: RadixTree,
        device_pool: KVPool,
        host_pool: KVPool,
        component_pools: Mapping[str, ComponentPools],
        release_queue: ReleaseQueue,
        copies: CopyTracker,
        prefetches: Callable[[], Iterable[Prefetch]],
    ) -> None:
        self._tree = tree
        self._device_pool = device_pool
        self._host_pool = host_pool
        self._component_pools = component_pools
        self._release_queue = release_queue
        self._copies = copies
        self._prefetches = prefetches

    def check(
        self,
        *,
        held_device_tokens: int = 0,
        held_component_slots: Mapping[str, int] | None = None,
        held_device: Sequence[torch.Tensor] | None = None,
        held_components: Mapping[str, Sequence[torch.Tensor]] | None = None,
    ) -> None:
        """See `HiCache.sanity_check`.

        Raises:
            InvariantViolation: listing every violation found.
        """
        tree = self._tree
        violations: list[str] = []
        try:
            tree.sanity_check()
        except InvariantViolation as exc:
            violations.extend(exc.violations)
        owned = tree.held_indices()
        device, host, pending = list(owned.device), list(owned.host), list(owned.backup_pending)
        comp = {key: list(values) for key, values in owned.components.items()}
        prefetches = list(self._prefetches())

        def in_flight(pool: KVPool) -> dict[Owner, list[torch.Tensor]]:
            prefetch: list[torch.Tensor] = []
            for p in prefetches:
                if pool is self._host_pool:
                    prefetch.append(p.host_indices)
                prefetch.extend(t.indices for t in p.transfers if t.pool is pool)
            return {
                Owner.COPY: list(self._copies.loading(pool)),
                Owner.PREFETCH: prefetch,
                Owner.RELEASE: self._release_queue.pending_indices(pool),
            }

        claims = in_flight(self._device_pool)
        claims[Owner.TREE] = device
        if held_device is not None:
            claims[Owner.LEASE] = list(held_device)
        check_owners(self._device_pool, "device pool", claims, held_device_tokens, violations)
        claims = in_flight(self._host_pool)
        claims[Owner.TREE] = host
        claims[Owner.COPY] = claims[Owner.COPY] + pending
        check_owners(self._host_pool, "host pool", claims, 0, violations)
        for c in tree.components:
            pools = self._component_pools[c.name]
            claims = in_flight(pools.device)
            claims[Owner.TREE] = comp.get((c.name, "device"), [])
            if held_components is not None and c.name in held_components:
                claims[Owner.LEASE] = list(held_components[c.name])
            held = held_component_slots.get(c.name, 0) if held_component_slots else 0
            check_owners(pools.device, f"{c.name} device pool", claims, held, violations)
            claims = in_flight(pools.host)
            claims[Owner.TREE] = comp.get((c.name, "host"), [])
            claims[Owner.COPY] = claims[Owner.COPY] + comp.get((c.name, "pending"), [])
            check_owners(pools.host, f"{c.name} host pool", claims, 0, violations)
        if violations:
            raise InvariantViolation(violations)


def check_owners(
    pool: KVPool,
    label: str,
    claims: Mapping[Owner, Sequence[torch.Tensor]],
    held_tokens: int,
    out: list[str],
) -> None:
    """Check that `pool`'s owner tags are exactly the partition `claims` describes (see `sanity_check`).

    `claims` maps an owner to the indices found held by it. Without an `Owner.LEASE` claim, pages tagged LEASE and found nowhere are the caller's:
    they must hold `held_tokens` indices.
    """
    size = pool.page_size
    tags = pool.owner_tags().to(torch.int64)
    num_pages = int(tags.numel())
    expected = torch.zeros(num_pages, dtype=torch.int64)  # Owner.FREE: found nowhere
    claimed = torch.zeros(num_pages, dtype=torch.int64)
    claim_sets: list[tuple[str, list[torch.Tensor]]] = [(o.name, list(p)) for o, p in claims.items()]
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
        expected[pages] = int(Owner[name])
    twice = (claimed > 1).nonzero().flatten()
    if twice.numel():
        out.append(f"{label}: pages {twice[:8].tolist()} are held by more than one owner")
    free = tags == int(Owner.FREE)
    claimed_free = (free & (claimed > 0)).nonzero().flatten()
    if claimed_free.numel():
        out.append(f"{label}: pages {claimed_free[:8].tolist()} are held but free in the pool")
    mismatch = (tags != expected) & ~free
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
