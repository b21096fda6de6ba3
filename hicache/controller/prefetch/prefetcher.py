"""The prefetches in flight: admission, streaming in the cache's task group, commit or drop, cancel."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator, Sequence

import torch

from hicache.config import HiCacheConfig
from hicache.controller.pages.allocation import Allocator
from hicache.controller.pages.release import ComponentTransfer, ReleaseBatch, ReleaseQueue
from hicache.controller.prefetch.admission import Admission, PrefetchPlan
from hicache.controller.prefetch.job import Prefetch, PrefetchOutcome, PrefetchState
from hicache.controller.prefetch.pacing import LoopPacer
from hicache.controller.prefetch.rescue import RefillRescue
from hicache.controller.state import OpenState
from hicache.controller.storage.guarded import GuardedStorage
from hicache.controller.storage.writer import KnownPages
from hicache.errors import UnknownRequest
from hicache.keys import TOKEN_BYTES, KeyLike, as_key_bytes
from hicache.memory import KVPool, Owner
from hicache.metrics import CacheMetrics
from hicache.parallel.agreement import Agreement, Decision
from hicache.tiers import DropReason, PrefetchStatus, SkipReason
from hicache.tree import ComponentFree, MatchResult, NodeRef, PrefixPeek, RadixTree
from storage_backends.cancellation import StopScope, uncancellable
from storage_backends.threads import stray_threads

__all__ = ["Prefetcher"]

logger = logging.getLogger("hicache.cache")

_COMPLETE = 1 << 40
"""Added to a commit decision's pages when this rank has every staged component (see `_stop_and_agree`)."""

_STOP_GRACE_S = 1.0
"""How long `cancel` waits for a stream to stop before resolving it detached. A stream stops within a few
event-loop turns (a cancelled read abandons its threads); this only bounds a backend that does not honour
cancellation."""


class Prefetcher:
    """Owns the prefetches in flight, from admission to commit, drop or cancel.

    Args:
        config: the cache's configuration.
        tree: the radix tree (anchors are host-locked there; committed pages are inserted there).
        allocator: takes host and component pages (evicting as needed) from its pools, where prefetched
            pages go; released (and quarantined) pages go to its release queue.
        metrics: the cache's metric set.
        state: whether the cache is open.
        agreement: the ranks' agreement: admission's probe and each commit's completed pages are agreed
            with it (for one rank its decisions resolve at once).

    The storage, with its breaker, is set once the storage tier is open (`storage`).
    """

    def __init__(
        self,
        config: HiCacheConfig,
        tree: RadixTree,
        allocator: Allocator,
        metrics: CacheMetrics,
        state: OpenState,
        agreement: Agreement,
    ) -> None:
        host_pool = allocator.host_pool
        self._config = config
        self._agreement = agreement
        self._commits: dict[str, Decision] = {}
        """Each launched prefetch's commit decision (the pages every rank has)."""
        self._tree = tree
        self._host_pool = host_pool
        self._component_pools = allocator.component_pools
        self._releaser = PrefetchRelease(host_pool, allocator.release_queue, config.page_size)
        self._allocator = allocator
        self._metrics = metrics
        self._state = state
        self._page_size = config.page_size
        self.pacer = LoopPacer()
        """One admission, launch or commit stage per loop iteration among the prefetches (issue 12)."""
        self._admission = Admission(
            config, tree, allocator, metrics, state, agreement, self.forget_stored, self.pacer
        )
        self._prefetches: dict[str, Prefetch] = {}
        self._starting: set[str] = set()
        """Request ids whose `start` is between its duplicate check and its launch (it awaits meanwhile)."""
        self.inflight_tokens = 0
        """Tokens of the prefetches in flight."""
        self._detached: set[Prefetch] = set()
        """Cancelled prefetches whose stream had not stopped yet: `_stream` releases them when it does."""
        self.storage: GuardedStorage | None = None
        """The storage backend behind its breaker (set once the storage tier is open)."""
        self.rescue: RefillRescue | None = None
        """Backs up an un-backed attach point before commit (`RefillPolicy.BACKUP_THEN_ATTACH`)."""
        self.known: KnownPages | None = None
        """Pages the storage writer takes as stored (set with the storage tier)."""
        self.spawn: Callable[..., None] | None = None
        """Runs a stream in the cache's workers, failing the cache if it raises (set while they run)."""

    def __len__(self) -> int:
        return len(self._prefetches)

    @property
    def detached(self) -> int:
        """Cancelled prefetches whose stream is still stopping."""
        return len(self._detached)

    def all_in_flight(self) -> Iterator[Prefetch]:
        """Every prefetch that still holds pages: those in flight and the detached ones."""
        yield from self._prefetches.values()
        yield from self._detached

    # ------------------------------------------------------------------ starting

    async def start(
        self,
        request_id: str,
        tokens: KeyLike,
        match: MatchResult | None,
        transfers: Sequence[ComponentTransfer],
    ) -> Prefetch | SkipReason:
        """Admit and start streaming a prefetch (see `HiCache.prefetch`), or count and return why not.

        Its first stage (key conversion, the peek, admission's page hashing and storage keys) runs in a
        turn of `pacer`: prefetches started together convert and hash one per loop iteration.
        """
        if request_id in self._prefetches or request_id in self._starting:
            raise ValueError(f"request_id: a prefetch for {request_id!r} is already in flight")
        self._check_transfers(transfers)
        self._starting.add(request_id)  # held across the awaits below: a second start is refused at once
        ticket = self.pacer.ticket()  # every stage of this prefetch goes ahead of those started later
        try:
            await self.pacer.turn(ticket)
            self._state.check_open("prefetch")
            key = as_key_bytes(tokens, name="tokens")
            page = self._page_size
            aligned = len(key) // TOKEN_BYTES // page * page
            key = key[: aligned * TOKEN_BYTES]
            if match is not None and not key.startswith(
                match.key[: (match.device_len + match.host_len) * TOKEN_BYTES]
            ):
                raise ValueError("match: it matched other tokens than `tokens` (call match(tokens))")
            found: MatchResult | PrefixPeek = match if match is not None else self._tree.peek(key)
            if isinstance(found, MatchResult) and not self._tree.is_live(found.last_host_node):
                found = self._tree.peek(key)  # evicted during the turn: as if none was given
            self._metrics.prefetch_requested.inc()
            storage = self.storage
            plan = await self._admission.plan(
                request_id, key, found, storage, self.inflight_tokens, ticket=ticket
            )
            if isinstance(plan, SkipReason):
                self._metrics.prefetch_skipped.labels(reason=plan.value).inc()
                return plan
            assert storage is not None
            return self._launch(request_id, plan, transfers, storage, ticket)
        finally:
            self._starting.discard(request_id)

    def _launch(
        self,
        request_id: str,
        plan: PrefetchPlan,
        transfers: Sequence[ComponentTransfer],
        storage: GuardedStorage,
        ticket: int,
    ) -> Prefetch:
        n_tokens = int(plan.host_indices.numel())
        prefetch = Prefetch(
            request_id=request_id,
            anchor=plan.anchor,
            key=plan.key,
            hashes=plan.hashes,
            page_keys=plan.page_keys,
            host_indices=plan.host_indices,
            page_size=self._page_size,
            stop_policy=self._config.prefetch_stop_policy,
            timeout_s=self._config.prefetch_timeout(n_tokens),
            transfers=transfers,
            staged=plan.staged,
            staged_reads=plan.staged_reads,
            ticket=ticket,
        )
        for transfer in transfers:  # the caller's buffers travel with the prefetch from here on
            if isinstance(transfer.pool, KVPool):
                transfer.pool.set_owner(transfer.indices, Owner.PREFETCH)
        spawn = self.spawn
        assert spawn is not None  # admission checked the cache is open after its last await
        self._prefetches[request_id] = prefetch
        # Proposed where every rank launches it: right after admission.
        self._commits[request_id] = self._agreement.propose("commit", request_id)
        self.inflight_tokens += prefetch.num_tokens
        self._metrics.prefetch_hit_tokens.inc(prefetch.num_tokens)
        spawn(self._stream, prefetch, storage)
        return prefetch

    async def _stream(self, prefetch: Prefetch, storage: GuardedStorage) -> None:
        try:
            await self.pacer.turn(prefetch.ticket)
            views = self._host_pool.page_views(prefetch.host_indices)
            # One bounded piece of loop work per step: concurrent prefetches launched together would
            # otherwise build their views and submit their first reads in one loop iteration (issue 12).
            await asyncio.sleep(0)
            await prefetch.stream(
                storage,
                views,
                self._config.batch_pages,
                self._config.storage_concurrency,
                read_timeout_s=self._config.storage_read_timeout_s,
            )
        finally:
            if prefetch in self._detached:  # cancelled meanwhile: its pages go back now
                self.finish_detached(prefetch)
        page_bytes = len(views[0]) if views else 0
        self._metrics.storage_bytes_read.inc(prefetch.completed_pages * page_bytes)
        if prefetch.timed_out_reads and isinstance(storage, GuardedStorage):
            for _ in range(prefetch.timed_out_reads):  # a read that timed out is a storage error
                storage.record_timeout("get")
        if prefetch.failed_pages:
            for reason, pages in prefetch.failure_reasons.items():
                self._metrics.storage_page_failures.labels(reason=reason).inc(pages)
            self.forget_stored(prefetch.page_keys[prefetch.completed_pages :])
            self.forget_stored(prefetch.unusable_keys)  # removed by the stream; component pages too

    def forget_stored(self, keys: Sequence[str]) -> None:
        """Storage lacks the first of `keys` (a probe or a read found it so): the writer must not take any
        of them as stored, so the next write-through of their path checks and puts them back."""
        if keys and self.known is not None:
            self.known.discard(keys)

    def _check_transfers(self, transfers: Sequence[ComponentTransfer]) -> None:
        """Refuse caller transfers holding pages the caller does not hold (a page twice included)."""
        by_pool: dict[int, tuple[KVPool, list[torch.Tensor]]] = {}
        for transfer in transfers:
            if isinstance(transfer.pool, KVPool):
                by_pool.setdefault(id(transfer.pool), (transfer.pool, []))[1].append(transfer.indices)
        for pool, parts in by_pool.values():
            pool.check_owned(torch.cat(parts), Owner.LEASE, name="transfers")

    # ------------------------------------------------------------------ resolving

    def get(self, request_id: str) -> Prefetch:
        """The prefetch in flight for `request_id` (see `HiCache.get_prefetch`)."""
        prefetch = self._prefetches.get(request_id)
        if prefetch is not None:
            return prefetch
        if self._state.closed:
            raise self._state.closed_error(
                "request_id", f"the cache was closed; no prefetch for {request_id!r}"
            )
        raise UnknownRequest(f"request_id: no prefetch in flight for {request_id!r}")

    def is_in_flight(self, prefetch: Prefetch) -> bool:
        """Whether `prefetch` is still the one in flight for its request (not resolved meanwhile)."""
        return self._prefetches.get(prefetch.request_id) is prefetch

    def _check_still_in_flight(self, request_id: str, prefetch: Prefetch) -> None:
        """After an await: the prefetch may have been resolved meanwhile (by `aclose` or another call)."""
        if self._prefetches.get(request_id) is not prefetch:
            if self._state.closed:
                raise self._state.closed_error(
                    "request_id", f"the cache was closed while {request_id!r} was prefetching"
                )
            raise UnknownRequest(f"request_id: the prefetch for {request_id!r} was resolved meanwhile")

    async def commit(self, request_id: str) -> PrefetchOutcome:
        """Stop the prefetch after its stop policy, wait for its I/O, then attach or drop its pages (see
        `HiCache.commit_prefetch`)."""
        prefetch = self.get(request_id)
        agreed_pages, components_complete = await self._stop_and_agree(prefetch)
        # The ranks' decision is out of the agreement: the commit is carried out whole (a cancellation
        # meanwhile is re-raised once it is). Before this point a cancellation undid everything.
        return await uncancellable(self._carry_out(request_id, prefetch, agreed_pages, components_complete))

    async def _carry_out(
        self, request_id: str, prefetch: Prefetch, agreed_pages: int, components_complete: bool
    ) -> PrefetchOutcome:
        """The commit after the agreement: the refill rescue's backup, the commit's turn, then the
        outcome, decided and carried out atomically."""
        self._check_still_in_flight(request_id, prefetch)
        rescued = False
        if self.rescue is not None and not prefetch.staged:
            # Before the atomic part: back up what the refill would hang from (see `RefillRescue`).
            agreed_tokens = agreed_pages * self._page_size
            rescued = await self.rescue.prepare(prefetch, min(prefetch.completed_tokens, agreed_tokens))
            self._check_still_in_flight(request_id, prefetch)
        # Prefetches that stop together commit in loop iterations of their own.
        await self.pacer.turn(prefetch.ticket)
        self._check_still_in_flight(request_id, prefetch)
        # No await from here on: the outcome is decided and carried out atomically.
        del self._prefetches[request_id]
        self.inflight_tokens -= prefetch.num_tokens
        if prefetch.timed_out and prefetch.completed_pages < len(prefetch.page_keys):
            self._metrics.storage_page_failures.labels(reason="timeout").inc()
        page = self._page_size
        completed = min(prefetch.completed_tokens, agreed_pages * page)  # pages every rank verified
        host = prefetch.host_indices
        drop: DropReason | None = None
        loaded = present = quarantined = 0
        node: NodeRef | None = prefetch.anchor
        frees: tuple[ComponentFree, ...] = ()
        if prefetch.staged and (completed < prefetch.num_tokens or not components_complete):
            # All or nothing: a partial window or a missing state makes every page useless.
            drop = DropReason.COMPONENT_INCOMPLETE
        elif completed:
            result = self._tree.insert_host(
                prefetch.anchor,
                prefetch.key[: completed * TOKEN_BYTES],
                host[:completed],
                prefetch.hashes[: completed // page],
                components={t.component: t.indices for t in prefetch.staged} or None,
            )
            if result.host_insert_dropped:
                drop = DropReason.ANCHOR_NOT_BACKED_UP
            present = result.prefix_len
            node = result.node
            frees = result.component_frees
        if drop is not None:
            # One release call: the host pages and every component transfer, in a stable order.
            released, quarantined = self._releaser.release(prefetch, host[:0], 0, prefetch.transfers)
            prefetch.state = PrefetchState.DROPPED
            self._metrics.prefetch_dropped_tokens.labels(reason=drop.value).inc(completed)
        else:
            loaded = completed - present
            # The tree took the loaded pages and the staged component buffers (what it did not keep of
            # those is freed below).
            self._host_pool.set_owner(host[present:completed], Owner.TREE)
            for transfer in prefetch.staged:
                self._component_pools[transfer.component].host.set_owner(transfer.indices, Owner.TREE)
            caller_transfers = prefetch.transfers[: len(prefetch.transfers) - len(prefetch.staged)]
            released, quarantined = self._releaser.release(
                prefetch, host[:present], completed // page, caller_transfers
            )
            self._allocator.free_components(frees)
            prefetch.state = PrefetchState.COMMITTED
            self._metrics.prefetch_committed.inc()
            self._metrics.prefetch_loaded_tokens.inc(loaded)
        self._tree.unlock_host(prefetch.anchor)
        self._metrics.prefetch_latency.observe(time.monotonic() - prefetch.started_at)
        outcome = PrefetchOutcome(
            request_id=request_id,
            status=PrefetchStatus(prefetch.state.value),
            completed_tokens=completed,
            matched_tokens=prefetch.num_tokens,
            loaded_tokens=loaded,
            released_tokens=released,
            failed_pages=prefetch.failed_pages,
            node=node,
            quarantined_tokens=quarantined,
            drop_reason=drop,
            rescued=rescued and drop is None,
        )
        logger.info(
            "prefetch %s request=%s completed=%d matched=%d loaded=%d released=%d",
            outcome.status.value,
            request_id,
            completed,
            outcome.matched_tokens,
            loaded,
            outcome.released_tokens,
        )
        return outcome

    async def _stop_and_agree(self, prefetch: Prefetch) -> tuple[int, bool]:
        """Wait for the stop policy and the stream to stop, and agree the pages completed (the minimum
        over the ranks; this rank keeps stepping while it waits) and whether every rank has its staged
        components: (pages, complete)."""

        async def stop() -> int:
            await prefetch.wait_for_stop_policy()
            prefetch.request_stop()
            await prefetch.wait_stopped()  # prompt: a cancelled read abandons its threads
            # Staged components are all or nothing: a rank missing one has no usable page (every rank
            # then drops the prefetch, `COMPONENT_INCOMPLETE`). Complete ranks count above any other.
            return prefetch.completed_pages + (_COMPLETE if prefetch.components_complete else 0)

        decision = self._commits.pop(prefetch.request_id)
        try:
            agreed = await self._agreement.agree_on(decision, stop)
        except BaseException:
            self._commits.setdefault(prefetch.request_id, decision)  # still in flight: commit again
            raise
        return agreed % _COMPLETE, agreed >= _COMPLETE

    async def cancel(self, request_id: str) -> PrefetchOutcome:
        """Stop the prefetch and give its pages back (see `HiCache.cancel_prefetch`)."""
        prefetch = self.get(request_id)
        prefetch.request_stop()
        try:
            async with StopScope(_STOP_GRACE_S):
                await prefetch.wait_stopped()
        except BaseException:
            if self._prefetches.get(request_id) is prefetch:
                self.cancel_now(prefetch)  # the caller's deadline passed: resolve it detached
            raise
        self._check_still_in_flight(request_id, prefetch)
        return self.cancel_now(prefetch)

    async def stop_and_cancel(self, prefetch: Prefetch) -> None:
        """Cleanup of a caller already cancelled: stop the stream, wait (shielded, at most `_STOP_GRACE_S`;
        a stream stops within a few loop turns) so its pages go back before the caller's error
        propagates, then resolve it; if it has not stopped by then, it is resolved detached."""
        prefetch.request_stop()
        try:
            await uncancellable(self._wait_stopped_within_grace(prefetch))
        finally:
            if self._prefetches.get(prefetch.request_id) is prefetch:
                self.cancel_now(prefetch)

    @staticmethod
    async def _wait_stopped_within_grace(prefetch: Prefetch) -> None:
        async with StopScope(_STOP_GRACE_S):
            await prefetch.wait_stopped()

    def cancel_all(self) -> None:
        """Resolve every prefetch in flight as cancelled, without awaiting (the cache is closing)."""
        for prefetch in list(self._prefetches.values()):
            self.cancel_now(prefetch)

    def cancel_now(self, prefetch: Prefetch) -> PrefetchOutcome:
        """Resolve `prefetch` as cancelled without awaiting: its pages go back now if its stream has
        stopped, otherwise when it stops (`finish_detached`)."""
        request_id = prefetch.request_id
        prefetch.request_stop()
        decision = self._commits.pop(request_id, None)
        if decision is not None:  # this rank has none of its pages: the ranks agree 0 at its next step
            decision.settle(0)
        del self._prefetches[request_id]
        self.inflight_tokens -= prefetch.num_tokens
        prefetch.state = PrefetchState.CANCELLED
        self._tree.unlock_host(prefetch.anchor)
        self._metrics.prefetch_cancelled.inc()
        if prefetch.done:
            released, quarantined = self._releaser.release(
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
            status=PrefetchStatus.CANCELLED,
            completed_tokens=prefetch.completed_tokens,
            matched_tokens=prefetch.num_tokens,
            loaded_tokens=0,
            released_tokens=released,
            failed_pages=prefetch.failed_pages,
            node=prefetch.anchor,
            quarantined_tokens=quarantined,
        )

    def finish_detached(self, prefetch: Prefetch) -> None:
        """The stream of a cancelled prefetch stopped (or will never run): give its pages back."""
        self._detached.discard(prefetch)
        self._releaser.release(prefetch, prefetch.host_indices[:0], 0, prefetch.transfers)

    def finish_all_detached(self) -> None:
        """The workers stopped: no stream can write into a detached prefetch's pages any more."""
        for prefetch in list(self._detached):
            self.finish_detached(prefetch)


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
