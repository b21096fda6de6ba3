"""What a `HiCache` shows of itself: `statistics()`, `repr`, and `sanity_check()` (its invariants).

A mixin of `HiCache` (its state and collaborators are the cache's own, built in `HiCache.__init__`): it
reads the tree, the pools, the queues and the breaker, asks `Accounting` for the page-by-page check and,
under tensor parallelism, compares the ranks' tree fingerprints. It changes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from hicache.controller.parts import CacheParts
from hicache.controller.results import CacheStatistics, ComponentPoolStatistics
from hicache.parallel import check_same_tree, check_same_tree_async

__all__ = ["CacheObservation"]


class CacheObservation(CacheParts):
    """Statistics, `repr` and the sanity check of a `HiCache` (the cache's parts: `CacheParts`)."""

    def statistics(self) -> CacheStatistics:
        """A frozen snapshot of the tree, the pools, the release queue and the work in flight."""
        release = self._release_queue.statistics()
        return CacheStatistics(
            tree=self._tree.statistics(),
            device_pool=self._device_pool.statistics(),
            host_pool=self._host_pool.statistics(),
            release_queue=release,
            prefetches_in_flight=len(self._prefetcher),
            prefetch_tokens_in_flight=self._prefetcher.inflight_tokens,
            backups_queued=len(self._mover.backups),
            storage_writes_queued=len(self._mover.storage_writes),
            closed=self._state.closed,
            quarantined_pages=release.quarantined_tokens // self.page_size,
            detached_prefetches=self._prefetcher.detached,
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
            f"host={h.used_pages}/{h.capacity_pages} pages prefetches={len(self._prefetcher)} "
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
        if across_ranks and self.agreement is not None:
            assert self.config.tp_group is not None
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
        if across_ranks and self.agreement is not None:
            assert self.config.tp_group is not None
            await check_same_tree_async(self.config.tp_group, self._tree)
