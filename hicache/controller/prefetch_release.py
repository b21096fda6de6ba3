"""Giving a prefetch's host pages and component transfers back: to the release queue, or quarantined while
a stray storage read may still write into them (`storage_backends.threads.stray_threads`)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from hicache.controller.prefetch import Prefetch
from hicache.controller.release import ComponentTransfer, ReleaseBatch, ReleaseQueue
from hicache.memory import KVPool, Owner
from storage_backends.threads import stray_threads

__all__ = ["PrefetchRelease"]

logger = logging.getLogger("hicache.cache")  # as the prefetcher's: one logger for the cache's prefetches


class PrefetchRelease:
    """Releases what prefetches held, tagging every page `Owner.RELEASE` on its way to the release queue.

    Args:
        host_pool: the host KV pool the prefetches' pages come from.
        release_queue: where released pages and transfers go (and quarantined ones wait).
        page_size: tokens per page.
    """

    def __init__(self, host_pool: KVPool, release_queue: ReleaseQueue, page_size: int) -> None:
        self._host_pool = host_pool
        self._release_queue = release_queue
        self._page_size = page_size

    def release(
        self, prefetch: Prefetch, quiet: torch.Tensor, tail_page: int, transfers: Sequence[ComponentTransfer]
    ) -> tuple[int, int]:
        """Release `quiet` host indices, the prefetch's host pages from page `tail_page` on, and `transfers`
        in one release call; pages and staged transfers a stray read may still write into are quarantined
        instead (released once its thread returns). Returns (tokens released, of which quarantined)."""
        page = self._page_size
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
            self._release_queue.quarantine(held_pages, held, views=views)
            logger.warning(
                "prefetch %s: %d host pages quarantined until a stuck storage read returns",
                prefetch.request_id,
                held_pages.numel() // page,
            )
        quarantined = int(held_pages.numel())
        return batch.num_tokens + quarantined, quarantined

    def _release_buffers(
        self, host_indices: torch.Tensor, transfers: Sequence[ComponentTransfer]
    ) -> ReleaseBatch:
        """Hand host pages and component transfers to the release queue, tagged as pending release."""
        self._tag_released(host_indices, transfers)
        return self._release_queue.release(host_indices, transfers)

    def _tag_released(self, host_indices: torch.Tensor, transfers: Sequence[ComponentTransfer]) -> None:
        """Tag pages handed to the release queue (pending, or quarantined first) as `Owner.RELEASE`."""
        self._host_pool.set_owner(host_indices, Owner.RELEASE)
        for transfer in transfers:
            if isinstance(transfer.pool, KVPool):
                transfer.pool.set_owner(transfer.indices, Owner.RELEASE)
