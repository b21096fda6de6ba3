"""Refill rescue: a storage refill whose attach point is not backed up is attached after backing the
attach point's chain up, instead of being dropped (`RefillPolicy.BACKUP_THEN_ATTACH`).

Under write-through a host node must never hang below a device-only one, so `insert_host` drops a refill
whose attach point (a fresh device prefix, not backed up yet) is not on the host: correct, but the loaded
pages are wasted and the request recomputes them. The rescue runs inside the prefetch commit, before its
atomic part: the tree plans (`RadixTree.refill_backup_plan`: the un-backed chain, root first), this class
backs the chain up through `TierMover.back_up` (device -> host, as write-through would have), and the commit
then calls `insert_host` as always, which attaches, or drops exactly as before when the backup did not
happen (no host room, a failed copy). Meanwhile the anchor stays host-locked (by the prefetch), the
chain's last node device-locked (here) and the refill's pages held by the prefetch; a cancellation in
between leaves the prefetch in flight, and its cancel releases everything in one call.
"""

from __future__ import annotations

import logging

from hicache.controller.movement.tier_mover import TierMover
from hicache.controller.prefetch.job import Prefetch
from hicache.keys import TOKEN_BYTES
from hicache.tree import RadixTree

__all__ = ["RefillRescue"]

logger = logging.getLogger("hicache.cache")


class RefillRescue:
    """Backs up the un-backed chain a refill would hang from, so the commit can attach it.

    Args:
        tree: the radix tree that plans the backup.
        mover: runs the backup (device -> host copy, commit into the tree).
    """

    def __init__(self, tree: RadixTree, mover: TierMover) -> None:
        self._tree = tree
        self._mover = mover
        self.attempted = 0
        """Refills whose attach point needed a backup."""
        self.backed_up = 0
        """Of those, the ones whose backup landed (the commit then attaches them)."""

    async def prepare(self, prefetch: Prefetch, completed_tokens: int | None = None) -> bool:
        """Back up what `prefetch`'s completed refill would hang from, if it is not backed up.

        Returns whether a backup was needed and landed. A backup that finds no host room or whose copy
        fails returns False (the commit then drops the refill as `RefillPolicy.DROP` does). The commit
        runs it after the ranks' agreement, where no cancellation reaches it (a commit is then carried out
        whole); a caller that cancels it directly gets the backup undone (`TierMover.back_up` aborts it). Under tensor
        parallelism `completed_tokens` is the agreed length of the refill (the plan is then the same on
        every rank) and the backup is agreed (`TierMover.back_up`): landed on every rank, or on none.
        """
        completed = prefetch.completed_tokens if completed_tokens is None else completed_tokens
        if not completed:
            return False
        plan = self._tree.refill_backup_plan(prefetch.anchor, prefetch.key[: completed * TOKEN_BYTES])
        if not plan:
            return False
        self.attempted += 1
        last = plan[-1]
        self._tree.lock_device(last)  # the chain stays on the device while it is copied
        try:
            done = await self._mover.back_up([last])
        except Exception as exc:  # a failed copy: drop as today
            logger.warning("refill rescue of %s: backup failed (%r); dropping", prefetch.request_id, exc)
            return False
        finally:
            self._tree.unlock_device(last)
        if done:
            self.backed_up += 1
        return bool(done)
