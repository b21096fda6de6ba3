"""Prefetch admission, from `start` to the launch: whether a request's storage hit is worth streaming
(a plan, or a skip reason), sized by a sparse `exists` probe, then the prefetch built and handed to the
registry of prefetches in flight (`job.Prefetches`), which streams it.

The probe (`probe_hit_pages`): an exact answer stats every page (4,096 `stat` calls for 16 prefetches of
256 pages); that was a quarter of the controller's prefetch time on hot 64 KiB pages (`bench/bench_io.py`).
Instead the probe asks `exists` about up to `fanout` evenly spaced pages of the range still in doubt, keeps
the bracket around the first absent probe, and repeats until the bracket is small enough to check page by
page. A full hit of 1,024 pages costs one call of 16 keys; a partial hit costs two or three calls. The
answer is exact when storage holds a prefix of the pages (what write-through to storage produces). With a
hole between two probes it overestimates; that is safe, because every page a prefetch reads is verified:
the stream ends at the first page it cannot read, and commit releases the unread tail.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hicache.components import component_storage_key
from hicache.config import HiCacheConfig
from hicache.controller.pages.allocation import Allocator
from hicache.controller.pages.release import ComponentTransfer
from hicache.controller.prefetch.job import Prefetch, Prefetches
from hicache.controller.state import OpenState
from hicache.controller.storage.guarded import GuardedStorage
from hicache.errors import StorageCircuitOpen
from hicache.keys import TOKEN_BYTES, KeyLike, as_key_bytes, chained_page_keys
from hicache.memory import KVPool, Owner
from hicache.metrics import CacheMetrics
from hicache.parallel.agreement import Agreement, decode_max, encode_max
from hicache.tiers import SkipReason, Tier
from hicache.tree import MatchResult, NodeRef, PrefixPeek, RadixTree
from storage_backends.cancellation import StopScope
from storage_backends.protocol import StorageBackend

__all__ = ["Admission", "PrefetchPlan", "probe_hit_pages"]

logger = logging.getLogger("hicache.cache")

_NO_EVICTION = 1 << 60
"""The eviction decision carries `_NO_EVICTION - tokens` so that the agreed minimum is the largest need."""

_SKIPS = (SkipReason.STORAGE_ERROR, SkipReason.STORAGE_UNAVAILABLE, SkipReason.CAPACITY, SkipReason.HOST_FULL)
"""A rank's reasons to skip before the hit is agreed, least telling first: its code is the index plus one
(0: none), and the ranks agree the highest code. No code and too short an agreed hit: `STORAGE_MISS`."""

_STAGE_SKIPS = (
    SkipReason.HOST_FULL,
    SkipReason.COMPONENT_HOST_FULL,
    SkipReason.STORAGE_UNAVAILABLE,
    SkipReason.STORAGE_ERROR,
    SkipReason.COMPONENT_MISS,
)
"""Why a rank cannot stage an admitted prefetch's components, as codes (the index; `len(_STAGE_SKIPS)`:
staged) of which the ranks agree the lowest: a host pool that took too few pages first (`HOST_FULL`)."""

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
    """Starts prefetches: decides whether to (thresholds, capacity, the storage probe, host room and
    components, one plan for one rank and N), then builds the `Prefetch` and launches it.

    Args:
        config: the cache's configuration (thresholds, capacity, timeouts).
        tree: the radix tree (the anchor is host-locked there).
        allocator: takes host and component pages (evicting as needed) from its pools, where
            prefetched pages go.
        metrics: the cache's metric set.
        state: whether the cache is still open after an await.
        agreement: the ranks' agreement: the probe's hit, the host room to make and the skip code are
            agreed with it (`plan`; for one rank its decisions resolve at once).
        prefetches: the prefetches in flight: admitted ones are launched there; its storage, pacer,
            tokens in flight and `forget_stored` are the ones admission uses.

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
        prefetches: Prefetches,
    ) -> None:
        self._config = config
        self._page_size = config.page_size
        self._tree = tree
        self._host_pool = allocator.host_pool
        self._component_pools = allocator.component_pools
        self._allocator = allocator
        self._metrics = metrics
        self._state = state
        self._prefetches = prefetches
        self._forget_stored = prefetches.forget_stored
        self._pacer = prefetches.pacer
        self._agreement = agreement
        self._admitting_tokens = 0
        """Tokens of the plans between their capacity check and their return: they await the probe
        meanwhile, and count toward the capacity as if in flight (the caller launches a plan in the same
        step it returns it)."""
        self._starting: set[str] = set()
        """Request ids whose `start` is between its duplicate check and its launch (it awaits meanwhile)."""

    async def start(
        self,
        request_id: str,
        tokens: KeyLike,
        match: MatchResult | None,
        transfers: Sequence[ComponentTransfer],
    ) -> Prefetch | SkipReason:
        """Admit and start streaming a prefetch (see `HiCache.prefetch`), or count and return why not.

        Its first stage (key conversion, the peek, admission's page hashing and storage keys) runs in a
        turn of `pacer`, the prefetch's one turn on its way down: prefetches started together convert and
        hash one per loop iteration. The probe's await separates that stage from the allocation and the
        launch; the stream's views and first reads come an iteration later again.
        """
        if request_id in self._prefetches or request_id in self._starting:
            raise ValueError(f"request_id: a prefetch for {request_id!r} is already in flight")
        self._check_transfers(transfers)
        self._starting.add(request_id)  # held across the awaits below: a second start is refused at once
        ticket = self._pacer.ticket()  # every stage of this prefetch goes ahead of those started later
        try:
            await self._pacer.turn(ticket)
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
            storage = self._prefetches.storage
            plan = await self.plan(request_id, key, found, storage, self._prefetches.inflight_tokens)
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
        self._prefetches.launch(prefetch, storage)
        return prefetch

    def _check_transfers(self, transfers: Sequence[ComponentTransfer]) -> None:
        """Refuse caller transfers holding pages the caller does not hold (a page twice included)."""
        by_pool: dict[int, tuple[KVPool, list[torch.Tensor]]] = {}
        for transfer in transfers:
            if isinstance(transfer.pool, KVPool):
                by_pool.setdefault(id(transfer.pool), (transfer.pool, []))[1].append(transfer.indices)
        for pool, parts in by_pool.values():
            pool.check_owned(torch.cat(parts), Owner.LEASE, name="transfers")

    async def plan(
        self,
        request_id: str,
        key: bytes,
        match: MatchResult | PrefixPeek,
        storage: GuardedStorage | None,
        inflight_tokens: int,
    ) -> PrefetchPlan | SkipReason:
        """Admit a prefetch of the storage hit of page-aligned `key` beyond `match`, or say why not.

        Skipped when there is no storage, the remainder beyond the match is below `prefetch_threshold`,
        `inflight_tokens` plus the remainders of the plans still being admitted plus it would exceed the
        capacity, storage is down or holds too few of the pages, or the host pool cannot take enough of
        them. Nothing stays held on a skip.

        One path for one rank and N: what depends on this rank (capacity, the breaker, storage's hit,
        host room) becomes its values in decisions agreed in one step: the hit (minimum over the ranks),
        the host tokens to evict for it (maximum) and a skip code (maximum: the most telling reason any
        rank has, `_SKIPS`). Every rank then evicts the same from its identical tree and takes what its
        pool has free, never evicting on its own; a rank that gets fewer pages reads fewer, and the
        commit's agreement shortens every rank's prefix to match. For one rank every decision resolves
        as it is settled, with no step.
        """
        config = self._config
        remainder = len(key) // TOKEN_BYTES - (match.device_len + match.host_len)
        if storage is None:
            return SkipReason.NO_STORAGE
        if remainder <= 0 or remainder < config.prefetch_threshold:
            return SkipReason.BELOW_THRESHOLD
        # Every rank reaches this point alike (the tree is identical). Counted from its check until it
        # returns, staging included: a plan admitted meanwhile sees it. The capacity is this rank's value.
        admitting = self._admitting_tokens
        self._admitting_tokens += remainder
        try:
            return await self._plan(request_id, key, match, storage, inflight_tokens + admitting)
        finally:
            self._admitting_tokens -= remainder

    async def _plan(
        self,
        request_id: str,
        key: bytes,
        match: MatchResult | PrefixPeek,
        storage: GuardedStorage,
        inflight_tokens: int,
    ) -> PrefetchPlan | SkipReason:
        """`plan` past the checks every rank makes alike: anchor, hash, agree the probe, allocate, stage."""
        agreement = self._agreement
        config = self._config
        page = config.page_size
        tree = self._tree
        matched = match.device_len + match.host_len
        remainder = len(key) // TOKEN_BYTES - matched
        probe = agreement.propose("probe", request_id)
        skip = agreement.propose("probe_skip", request_id, default=encode_max(0))
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
            reason: SkipReason | None = None
            try:
                if inflight_tokens + remainder > config.capacity_tokens:
                    reason = SkipReason.CAPACITY
                    return 0
                if not storage.breaker.allows():  # storage is down and no probe is due: no I/O at all
                    reason = SkipReason.STORAGE_UNAVAILABLE
                    return 0
                # Hashing and the probe's submission are separate loop iterations.
                await asyncio.sleep(0)
                probed = await self._probe(request_id, storage, page_keys, remainder)
                hit_pages = 0 if isinstance(probed, SkipReason) else probed
                reason = probed if isinstance(probed, SkipReason) else None
                self._forget_stored(page_keys[hit_pages:])
                hit = hit_pages * page
                if reason is None and anchor_end + hit - matched >= config.prefetch_threshold:
                    room = self._allocator.host_room()  # free pages and what eviction can reclaim
                    if anchor_end + min(hit, room) - matched < config.prefetch_threshold:
                        reason = SkipReason.HOST_FULL
                need = hit - self._allocator.free_host_tokens()
                evict.settle(_NO_EVICTION - max(0, need))
                for comp, room_decision in zip(tree.components, rooms, strict=True):
                    # The slots of this rank's hit: the agreed hit is no longer, so it needs no more.
                    slots = (
                        comp.prefix_pages(hit_pages * page, page)
                        * self._component_pools[comp.name].host.page_size
                    )
                    lack = slots - self._allocator.free_component_slots(comp.name, Tier.HOST)
                    room_decision.settle(encode_max(max(0, lack)))
                return hit_pages
            finally:
                # Every path settles them (a no-op once settled above).
                skip.settle(encode_max(0 if reason is None else _SKIPS.index(reason) + 1))
                evict.settle(_NO_EVICTION)
                for room_decision in rooms:
                    room_decision.settle(encode_max(0))

        tree.lock_host(anchor)
        try:
            hit_pages = await agreement.agree_on(probe, local)
            code = decode_max(await agreement.agree(skip))
            to_evict = _NO_EVICTION - await agreement.agree(evict)
            comp_evict = [decode_max(await agreement.agree(room)) for room in rooms]
            self._state.check_open("prefetch")
            if code or anchor_end + hit_pages * page - matched < config.prefetch_threshold:
                tree.unlock_host(anchor)
                return _SKIPS[code - 1] if code else SkipReason.STORAGE_MISS
            if to_evict:
                self._allocator.evict_host(to_evict)
            host_indices = self._allocator.alloc_host_free(hit_pages * page, owner=Owner.PREFETCH)
        except BaseException:
            skip.settle(encode_max(0))
            evict.settle(_NO_EVICTION)
            for room in rooms:
                room.settle(encode_max(0))
            tree.unlock_host(anchor)
            raise
        staged: tuple[list[ComponentTransfer], _StagedReads] = ([], [])
        if tree.components:
            got = await self._stage(request_id, storage, hashes[:hit_pages], host_indices, anchor, comp_evict)
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

    async def _stage(
        self,
        request_id: str,
        storage: GuardedStorage,
        hashes: Sequence[bytes],
        host_indices: torch.Tensor,
        anchor: NodeRef,
        comp_evict: Sequence[int],
    ) -> tuple[list[ComponentTransfer], _StagedReads] | SkipReason:
        """Stage the components of an admitted prefetch, all or nothing on every rank: each rank evicts the
        agreed component slots (the same from its identical tree), then looks its component pages up
        and takes its slots; one `stage` decision (the least over the ranks of a code, `_STAGE_SKIPS`,
        whose top value says this rank has every page of the agreed hit and every component staged)
        agrees whether the prefetch goes on. If not, every rank lets go of everything and skips alike,
        with the reason of the lowest code. One more step per prefetch with components (none for one
        rank)."""
        agreement = self._agreement
        tree = self._tree
        page = self._config.page_size
        for comp, need in zip(tree.components, comp_evict, strict=True):
            self._allocator.evict_component_slots(comp.name, Tier.HOST, need)
        stage = agreement.propose("stage", request_id)
        got: list[tuple[list[ComponentTransfer], _StagedReads]] = []

        async def local() -> int:
            if host_indices.numel() < len(hashes) * page:
                return _STAGE_SKIPS.index(SkipReason.HOST_FULL)
            staged = await self._stage_components(storage, hashes, len(hashes) * page)
            if isinstance(staged, SkipReason):
                return _STAGE_SKIPS.index(staged)
            got.append(staged)
            return len(_STAGE_SKIPS)

        try:
            ok = await agreement.agree_on(stage, local)
            self._state.check_open("prefetch")
        except BaseException:
            self._let_go([t for transfers, _ in got for t in transfers], host_indices, anchor)
            raise
        if ok < len(_STAGE_SKIPS):
            self._let_go([t for transfers, _ in got for t in transfers], host_indices, anchor)
            return _STAGE_SKIPS[ok]
        assert got
        return got[0]

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
        self, storage: GuardedStorage, hashes: Sequence[bytes], num_tokens: int
    ) -> tuple[list[ComponentTransfer], _StagedReads] | SkipReason:
        """Host buffers and page keys of every component a prefix of `num_tokens` tokens needs at its end.

        All or nothing: a skip reason when storage lacks any of the pages (a partial window, no Mamba
        state) or a component's host pool cannot take them; nothing stays allocated then. Takes free
        slots only: the eviction for them was agreed before (`_stage`).
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
                indices = self._allocator.alloc_component_free(
                    comp.name, Tier.HOST, slots, owner=Owner.PREFETCH
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


EXACT_BELOW = 64
"""A bracket this small (in pages) is checked page by page, in one call."""
FANOUT = 16
"""Pages probed per call while the bracket is larger."""


async def probe_hit_pages(
    storage: StorageBackend, keys: Sequence[str], *, exact_below: int = EXACT_BELOW, fanout: int = FANOUT
) -> int:
    """The number of leading `keys` that storage holds, assuming it holds a prefix of them.

    Args:
        storage: the backend to ask.
        keys: the page keys of the prefetch, in order.
        exact_below: brackets of fewer pages are checked page by page.
        fanout: pages probed per call in a larger bracket (>= 2).

    Raises:
        ValueError: naming `fanout` or `exact_below` when below their minimum; whatever
            `storage.exists` raises.
    """
    if fanout < 2:
        raise ValueError(f"fanout: expected >= 2, got {fanout}")
    if exact_below < 1:
        raise ValueError(f"exact_below: expected >= 1, got {exact_below}")
    lo, hi = 0, len(keys)  # pages [0, lo) are taken as present; page `hi` is absent (or the end)
    while hi - lo > exact_below:
        step = (hi - lo) / fanout
        # Evenly spaced, the last probe on the bracket's last page: a full hit is settled in one call.
        probes = sorted({lo + max(0, int(step * (i + 1)) - 1) for i in range(fanout)} | {hi - 1})
        present = await storage.exists([keys[p] for p in probes])
        if present == len(probes):
            return hi
        if present:
            lo = probes[present - 1] + 1
        hi = probes[present]
    return lo + (await storage.exists(keys[lo:hi]) if hi > lo else 0)
