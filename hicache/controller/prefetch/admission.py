"""Prefetch admission: whether a request's storage hit is worth streaming, as a plan or a skip reason."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hicache.components import component_storage_key
from hicache.config import HiCacheConfig
from hicache.controller.pages.allocation import Allocator
from hicache.controller.pages.release import ComponentTransfer
from hicache.controller.prefetch.pacing import LoopPacer
from hicache.controller.prefetch.probe import probe_hit_pages
from hicache.controller.state import OpenState
from hicache.controller.storage.guarded import GuardedStorage
from hicache.errors import StorageCircuitOpen
from hicache.keys import TOKEN_BYTES, chained_page_keys
from hicache.memory import Owner
from hicache.metrics import CacheMetrics
from hicache.parallel.agreement import Agreement, decode_max, encode_max
from hicache.tiers import SkipReason, Tier
from hicache.tree import MatchResult, NodeRef, PrefixPeek, RadixTree
from storage_backends.cancellation import StopScope

__all__ = ["Admission", "PrefetchPlan"]

logger = logging.getLogger("hicache.cache")

_NO_EVICTION = 1 << 60
"""The eviction decision carries `_NO_EVICTION - tokens` so that the agreed minimum is the largest need."""

_StagedReads = list[tuple[list[str], Sequence[memoryview]]]


@dataclass(frozen=True)
class PrefetchPlan:
    """An admitted prefetch: what to read into which host pages. The anchor is host-locked and the host
    pages and staged component buffers are allocated (`Owner.PREFETCH`) until the prefetch is resolved.

    Attributes:
        anchor: the match's last host node, where the prefetched pages will hang.
        key: token key of the prefetched pages, continuing from the anchor's end.
        hashes: their page hashes.
        page_keys: their storage keys.
        host_indices: the host pages they are read into.
        staged: component buffers the cache staged for them.
        staged_reads: per staged buffer, the storage keys and page views to read.
    """

    anchor: NodeRef
    key: bytes
    hashes: list[bytes]
    page_keys: list[str]
    host_indices: torch.Tensor
    staged: list[ComponentTransfer]
    staged_reads: _StagedReads


class Admission:
    """Decides whether to prefetch: thresholds, capacity, the storage probe, host room and components.

    Args:
        config: the cache's configuration (thresholds, capacity, timeouts).
        tree: the radix tree (the anchor is host-locked there).
        allocator: takes host and component pages (evicting as needed) from its pools, where
            prefetched pages go.
        metrics: the cache's metric set.
        state: whether the cache is still open after an await.
        agreement: the ranks' agreement: across several ranks the probe's hit and the host room to make
            are agreed (`_plan_agreed`).
        forget_stored: called with page keys storage was found to lack.
        pacer: hands out the loop turns an admission's stages wait for (shared with the prefetcher's
            launches and commits).

    The storage breaker (no I/O at all while it is open) is the one of the storage `plan` is given.
    """

    def __init__(
        self,
        config: HiCacheConfig,
        tree: RadixTree,
        allocator: Allocator,
        metrics: CacheMetrics,
        state: OpenState,
        agreement: Agreement,
        forget_stored: Callable[[Sequence[str]], None],
        pacer: LoopPacer,
    ) -> None:
        self._config = config
        self._tree = tree
        self._host_pool = allocator.host_pool
        self._component_pools = allocator.component_pools
        self._allocator = allocator
        self._metrics = metrics
        self._state = state
        self._forget_stored = forget_stored
        self._pacer = pacer
        self._agreement = agreement
        self._admitting_tokens = 0
        """Tokens of the plans between their capacity check and their return: they await the probe and
        the pacer meanwhile, and count toward the capacity as if in flight (the caller launches a plan
        in the same step it returns it)."""

    async def plan(
        self,
        request_id: str,
        key: bytes,
        match: MatchResult | PrefixPeek,
        storage: GuardedStorage | None,
        inflight_tokens: int,
        *,
        ticket: int | None = None,
    ) -> PrefetchPlan | SkipReason:
        """Admit a prefetch of the storage hit of page-aligned `key` beyond `match`, or say why not.

        Skipped when there is no storage, the remainder beyond the match is below `prefetch_threshold`,
        `inflight_tokens` plus the remainders of the plans still being admitted plus it would exceed the
        capacity, storage is down or holds too few of the pages, or the host pool cannot take enough of
        them. Nothing stays held on a skip. Called in a turn of the pacer; its allocation waits for
        another, shown `ticket` (the prefetch's, see `LoopPacer.ticket`). A `peek` is anchored here (the tree splits the node its anchor ends in, touching no LRU
        clock) only once the cheap checks pass.
        """
        config = self._config
        remainder = len(key) // TOKEN_BYTES - (match.device_len + match.host_len)
        if storage is None:
            return SkipReason.NO_STORAGE
        if remainder <= 0 or remainder < config.prefetch_threshold:
            return SkipReason.BELOW_THRESHOLD
        if not self._agreement.local:  # every rank reaches this point alike (the tree is identical)
            # Counted from its check until it returns, staging included, as on one rank: a plan admitted
            # meanwhile sees it. The capacity is this rank's value; the agreed hit is the least over ranks.
            admitting = self._admitting_tokens
            self._admitting_tokens += remainder
            try:
                return await self._plan_agreed(
                    request_id, key, match, storage, inflight_tokens + admitting, self._agreement
                )
            finally:
                self._admitting_tokens -= remainder
        if inflight_tokens + self._admitting_tokens + remainder > config.capacity_tokens:
            return SkipReason.CAPACITY
        if not storage.breaker.allows():  # storage is down and no probe is due: no I/O at all
            return SkipReason.STORAGE_UNAVAILABLE
        self._admitting_tokens += remainder
        try:
            return await self._admit(request_id, key, match, storage, remainder, ticket)
        finally:
            self._admitting_tokens -= remainder

    async def _admit(
        self,
        request_id: str,
        key: bytes,
        match: MatchResult | PrefixPeek,
        storage: GuardedStorage,
        remainder: int,
        ticket: int | None,
    ) -> PrefetchPlan | SkipReason:
        """`plan` past its cheap checks: anchor, hash, probe, allocate and stage the components."""
        config = self._config
        page = config.page_size
        matched = match.device_len + match.host_len
        tree = self._tree
        if isinstance(match, PrefixPeek):
            anchor = tree.node_at(key, match.anchor_len)
        else:
            anchor = match.last_host_node
        anchor_end = tree.depth(anchor)
        tree.lock_host(anchor)
        try:
            # This first stage runs in the caller's turn of the pacer, the allocation below in another:
            # of the prefetches started together, one hashes (or allocates) per loop iteration, so no
            # iteration carries all of their page hashing and storage keys (issue 12).
            hashes, page_keys = chained_page_keys(
                key[anchor_end * TOKEN_BYTES :], page, config.namespace, tree.last_hash(anchor)
            )
            # Hashing and the probe's submission are separate loop iterations too.
            await asyncio.sleep(0)  # a cancellation here or below unlocks the anchor (except, below)
            hit_pages = await self._probe(request_id, storage, page_keys, remainder)
            if isinstance(hit_pages, SkipReason):
                tree.unlock_host(anchor)
                return hit_pages
            await self._pacer.turn(ticket)
            self._state.check_open("prefetch")
            self._forget_stored(page_keys[hit_pages:])
            hit = hit_pages * page
            if anchor_end + hit - matched < config.prefetch_threshold:
                tree.unlock_host(anchor)
                return SkipReason.STORAGE_MISS
            host_indices = self._allocator.alloc_host(hit, owner=Owner.PREFETCH, partial=True)
            if (
                host_indices is None
                or anchor_end + host_indices.numel() - matched < config.prefetch_threshold
            ):
                if host_indices is not None:
                    self._host_pool.free(host_indices, owner=Owner.PREFETCH)
                tree.unlock_host(anchor)
                return SkipReason.HOST_FULL
        except BaseException:
            tree.unlock_host(anchor)
            raise
        n_pages = host_indices.numel() // page
        staged: list[ComponentTransfer] = []
        reads: _StagedReads = []
        if tree.components:
            got = await self._stage_components_or_free(
                storage, hashes[:n_pages], n_pages * page, host_indices, anchor
            )
            if isinstance(got, SkipReason):
                self._host_pool.free(host_indices, owner=Owner.PREFETCH)
                tree.unlock_host(anchor)
                return got
            staged, reads = got
        return PrefetchPlan(
            anchor=anchor,
            key=key[anchor_end * TOKEN_BYTES : (anchor_end + n_pages * page) * TOKEN_BYTES],
            hashes=hashes[:n_pages],
            page_keys=page_keys[:n_pages],
            host_indices=host_indices,
            staged=staged,
            staged_reads=reads,
        )

    async def _probe(
        self, request_id: str, storage: GuardedStorage, page_keys: list[str], remainder: int
    ) -> int | SkipReason:
        """Storage's hit in pages for `page_keys`, or why it is not known: `STORAGE_UNAVAILABLE` (the
        breaker refused the call) or `STORAGE_ERROR` (an error or a timeout, counted)."""
        config = self._config
        try:
            # A hung lookup must not hang the request: it gets the stream's budget, at most a read's.
            budget = min(config.prefetch_timeout(remainder), config.storage_read_timeout_s)
            async with StopScope(budget):
                return await probe_hit_pages(storage, page_keys)
            storage.record_timeout("exists")
            self._metrics.storage_page_failures.labels(reason="timeout").inc()
        except StorageCircuitOpen:  # another request holds the probe, or the breaker just opened
            return SkipReason.STORAGE_UNAVAILABLE
        except Exception as exc:  # a storage failure makes the prefetch empty, never the caller's error
            logger.warning("prefetch %s: storage lookup failed: %r", request_id, exc)
            self._metrics.storage_page_failures.labels(reason="exists").inc()
        return SkipReason.STORAGE_ERROR

    async def _plan_agreed(
        self,
        request_id: str,
        key: bytes,
        match: MatchResult | PrefixPeek,
        storage: GuardedStorage,
        inflight_tokens: int,
        agreement: Agreement,
    ) -> PrefetchPlan | SkipReason:
        """`plan` under tensor parallelism: what depends on this rank (capacity, the breaker, storage's
        hit, free host pages) becomes its value in two decisions agreed in one step: the hit (minimum
        over the ranks) and the host tokens to evict for it (maximum). Every rank then evicts the same
        from its identical tree and takes what its pool has free, never evicting on its own; a rank that
        gets fewer pages reads fewer, and the commit's agreement shortens every rank's prefix to match.
        """
        config = self._config
        page = config.page_size
        tree = self._tree
        matched = match.device_len + match.host_len
        remainder = len(key) // TOKEN_BYTES - matched
        probe = agreement.propose("probe", request_id)
        evict = agreement.propose("probe_evict", request_id, default=_NO_EVICTION)
        # Each component's host slots to evict for the staged reads ride on the probe's step.
        rooms = [agreement.propose("probe_component_room", f"{request_id}:{c.name}") for c in tree.components]
        anchor = (
            tree.node_at(key, match.anchor_len) if isinstance(match, PrefixPeek) else match.last_host_node
        )
        anchor_end = tree.depth(anchor)
        hashes, page_keys = chained_page_keys(
            key[anchor_end * TOKEN_BYTES :], page, config.namespace, tree.last_hash(anchor)
        )

        async def local() -> int:
            try:
                if inflight_tokens + remainder > config.capacity_tokens:
                    return 0
                if not storage.breaker.allows():
                    return 0
                probed = await self._probe(request_id, storage, page_keys, remainder)
                hit_pages = 0 if isinstance(probed, SkipReason) else probed
                self._forget_stored(page_keys[hit_pages:])
                need = hit_pages * page - self._allocator.free_host_tokens()
                evict.settle(_NO_EVICTION - max(0, need))
                for comp, room in zip(tree.components, rooms, strict=True):
                    # The slots of this rank's hit: the agreed hit is no longer, so it needs no more.
                    slots = (
                        comp.prefix_pages(hit_pages * page, page)
                        * self._component_pools[comp.name].host.page_size
                    )
                    lack = slots - self._allocator.free_component_slots(comp.name, Tier.HOST)
                    room.settle(encode_max(max(0, lack)))
                return hit_pages
            finally:
                evict.settle(_NO_EVICTION)  # every path settles it (a no-op once settled above)
                for room in rooms:
                    room.settle(encode_max(0))

        tree.lock_host(anchor)
        try:
            hit_pages = await agreement.agree_on(probe, local)
            to_evict = _NO_EVICTION - await agreement.agree(evict)
            comp_evict = [decode_max(await agreement.agree(room)) for room in rooms]
            self._state.check_open("prefetch")
            if anchor_end + hit_pages * page - matched < config.prefetch_threshold:
                tree.unlock_host(anchor)
                return SkipReason.STORAGE_MISS
            if to_evict:
                self._allocator.evict_host(to_evict)
            host_indices = self._allocator.alloc_host_free(hit_pages * page, owner=Owner.PREFETCH)
        except BaseException:
            evict.settle(_NO_EVICTION)
            for room in rooms:
                room.settle(encode_max(0))
            tree.unlock_host(anchor)
            raise
        staged: tuple[list[ComponentTransfer], _StagedReads] = ([], [])
        if tree.components:
            got = await self._stage_agreed(
                request_id, storage, hashes[:hit_pages], host_indices, anchor, comp_evict, agreement
            )
            if isinstance(got, SkipReason):
                return got
            staged = got
        n_pages = host_indices.numel() // page
        return PrefetchPlan(
            anchor=anchor,
            key=key[anchor_end * TOKEN_BYTES : (anchor_end + n_pages * page) * TOKEN_BYTES],
            hashes=hashes[:n_pages],
            page_keys=page_keys[:n_pages],
            host_indices=host_indices,
            staged=staged[0],
            staged_reads=staged[1],
        )

    async def _stage_agreed(
        self,
        request_id: str,
        storage: GuardedStorage,
        hashes: Sequence[bytes],
        host_indices: torch.Tensor,
        anchor: NodeRef,
        comp_evict: Sequence[int],
        agreement: Agreement,
    ) -> tuple[list[ComponentTransfer], _StagedReads] | SkipReason:
        """Stage the components of an agreed prefetch, all or nothing on every rank: each rank evicts the
        agreed component slots (the same from its identical tree), then looks its component pages up
        and takes its slots; one `stage` decision (2: this rank has every page of the agreed hit and
        every component staged) agrees whether the prefetch goes on. If not, every rank lets go of
        everything and skips alike (`HOST_FULL` or `COMPONENT_MISS`). One more step per prefetch with
        components."""
        tree = self._tree
        page = self._config.page_size
        for comp, need in zip(tree.components, comp_evict, strict=True):
            self._allocator.evict_component_slots(comp.name, Tier.HOST, need)
        # 2: staged; 1: a component page missing, or no slot for it; 0: the host pool did not take every
        # page of the agreed hit. The least over the ranks says why every rank skips.
        stage = agreement.propose("stage", request_id)
        got: list[tuple[list[ComponentTransfer], _StagedReads]] = []

        async def local() -> int:
            if host_indices.numel() < len(hashes) * page:
                return 0
            staged = await self._stage_components(storage, hashes, len(hashes) * page, evict=False)
            if isinstance(staged, SkipReason):
                return 1
            got.append(staged)
            return 2

        try:
            ok = await agreement.agree_on(stage, local)
            self._state.check_open("prefetch")
        except BaseException:
            self._let_go([t for transfers, _ in got for t in transfers], host_indices, anchor)
            raise
        if ok < 2:
            self._let_go([t for transfers, _ in got for t in transfers], host_indices, anchor)
            return SkipReason.HOST_FULL if ok == 0 else SkipReason.COMPONENT_MISS
        assert got
        return got[0]

    async def _stage_components_or_free(
        self,
        storage: GuardedStorage,
        hashes: Sequence[bytes],
        num_tokens: int,
        host_indices: torch.Tensor,
        anchor: NodeRef,
    ) -> tuple[list[ComponentTransfer], _StagedReads] | SkipReason:
        """`_stage_components` for a prefetch holding `host_indices` and a lock on `anchor`: if staging
        fails, or the cache closes meanwhile, the host pages, the lock and anything staged are let go."""
        got: tuple[list[ComponentTransfer], _StagedReads] | SkipReason | None = None
        try:
            got = await self._stage_components(storage, hashes, num_tokens)
            self._state.check_open("prefetch")
        except BaseException:
            self._let_go(got[0] if isinstance(got, tuple) else [], host_indices, anchor)
            raise
        return got

    def _let_go(
        self, staged: Sequence[ComponentTransfer], host_indices: torch.Tensor, anchor: NodeRef
    ) -> None:
        """Give back what a prefetch that will not launch holds: its staged component slots, its host pages
        and its lock on `anchor`. A pool already closed by `aclose` took its memory with it: nothing to
        give back there."""
        for transfer in staged:
            pool = self._component_pools[transfer.component].host  # the pool it was staged in
            if not pool.closed:
                pool.free(transfer.indices, owner=Owner.PREFETCH)
        if not self._host_pool.closed:
            self._host_pool.free(host_indices, owner=Owner.PREFETCH)
        self._tree.unlock_host(anchor)

    async def _stage_components(
        self, storage: GuardedStorage, hashes: Sequence[bytes], num_tokens: int, *, evict: bool = True
    ) -> tuple[list[ComponentTransfer], _StagedReads] | SkipReason:
        """Host buffers and page keys of every component a prefix of `num_tokens` tokens needs at its end.

        All or nothing: a skip reason when storage lacks any of the pages (a partial window, no Mamba
        state) or a component's host pool cannot take them; nothing stays allocated then. `evict`:
        whether to evict component values for the slots (not under tensor parallelism, where the
        eviction was agreed before).
        """
        staged: list[ComponentTransfer] = []
        reads: _StagedReads = []
        reason: SkipReason | None = None
        page = self._config.page_size
        try:
            for comp in self._tree.components:
                k = min(len(hashes), comp.prefix_pages(num_tokens, page))
                keys = [component_storage_key(h, comp.name) for h in hashes[len(hashes) - k :]]
                try:
                    present = 0
                    async with StopScope(self._config.storage_read_timeout_s) as lookup:
                        present = await storage.exists(keys) if keys else 0
                    if lookup.cut_short:  # a hung lookup is a storage error, never a miss
                        logger.warning("prefetch: component lookup timed out")
                        storage.record_timeout("exists")
                        self._metrics.storage_page_failures.labels(reason="timeout").inc()
                        reason = SkipReason.STORAGE_ERROR
                        break
                except StorageCircuitOpen:
                    reason = SkipReason.STORAGE_UNAVAILABLE
                    break
                except OSError as exc:  # a storage error (counted by the guard), never the caller's
                    logger.warning("prefetch: component lookup failed: %r", exc)
                    reason = SkipReason.STORAGE_ERROR
                    break
                if not keys or present < len(keys):
                    reason = SkipReason.COMPONENT_MISS
                    break
                host_pool = self._component_pools[comp.name].host
                slots = k * host_pool.page_size
                indices = (
                    self._allocator.alloc_component_slots(comp.name, Tier.HOST, slots, owner=Owner.PREFETCH)
                    if evict
                    else self._allocator.alloc_component_free(
                        comp.name, Tier.HOST, slots, owner=Owner.PREFETCH
                    )
                )
                if indices is None:
                    reason = SkipReason.COMPONENT_HOST_FULL
                    break
                staged.append(ComponentTransfer(comp.name, host_pool, indices))
                reads.append((keys, host_pool.page_views(indices)))
        except BaseException:
            for transfer in staged:
                self._component_pools[transfer.component].host.free(transfer.indices, owner=Owner.PREFETCH)
            raise
        if reason is not None:
            for transfer in staged:
                self._component_pools[transfer.component].host.free(transfer.indices, owner=Owner.PREFETCH)
            return reason
        return staged, reads
