"""A storage prefetch as an object with a lifecycle: started, streaming, terminated, then committed or dropped;
and the registry of the prefetches in flight (`Prefetches`), which runs their streams and commits, drops or
cancels them.

Pages in flight belong to the prefetch, not to the tree: they are invisible to matching and cannot be
evicted. The anchor node is host-locked for the prefetch's whole life so it cannot be evicted either.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from hicache.config import HiCacheConfig
from hicache.controller.pages.allocation import Allocator
from hicache.controller.pages.release import ComponentTransfer, ReleaseBatch, ReleaseQueue
from hicache.controller.prefetch.pacing import LoopPacer
from hicache.controller.state import OpenState
from hicache.controller.storage.guarded import GuardedStorage
from hicache.controller.storage.writer import KnownPages
from hicache.errors import UnknownRequest
from hicache.keys import TOKEN_BYTES
from hicache.memory import KVPool, Owner
from hicache.metrics import CacheMetrics
from hicache.parallel.agreement import Agreement, Decision
from hicache.policy import StopPolicy
from hicache.tiers import DropReason, PrefetchStatus
from hicache.tree import ComponentFree, NodeRef, RadixTree
from storage_backends.cancellation import StopScope, carried_out, uncancellable
from storage_backends.protocol import PageStatus, StorageBackend
from storage_backends.threads import stray_threads

if TYPE_CHECKING:
    from hicache.controller.prefetch.rescue import RefillRescue

__all__ = ["Prefetch", "PrefetchOutcome", "PrefetchState", "Prefetches"]

logger = logging.getLogger("hicache.prefetch")
cache_logger = logging.getLogger("hicache.cache")
"""The registry's log (prefetch outcomes), under the cache's name as before."""


_UNUSABLE = frozenset({PageStatus.CORRUPT, PageStatus.FOREIGN, PageStatus.OLD_FORMAT})
"""Page statuses that say the stored object under a key can never be loaded by anyone: damaged, another
namespace's or key's page, or an old format. Our own namespace owns the key, so such an object is ours to
remove (`unusable_keys`), and the write-through can then put the real page back."""


def _reason(status: object) -> str:
    """The metric reason of a page `get` did not load (`"read"` from a backend that reports no status)."""
    return status.value if isinstance(status, PageStatus) else "read"


class PrefetchState(enum.Enum):
    """Where a prefetch is in its life."""

    STREAMING = "streaming"
    """Pages are being read from storage into its host pages."""
    TERMINATED = "terminated"
    """Streaming has stopped (complete, failed, timed out or asked to stop); no read is awaited any more
    (a stray thread of an abandoned read may still write into some pages: see `Prefetch.busy_pages`)."""
    COMMITTED = "committed"
    """Its pages were attached to the tree."""
    DROPPED = "dropped"
    """Commit found the anchor not backed up under write-through: every buffer went to the release queue."""
    CANCELLED = "cancelled"
    """It was cancelled: every buffer went to the release queue once its I/O had stopped."""


@dataclass(frozen=True)
class PrefetchOutcome:
    """What `commit_prefetch` or `cancel_prefetch` did.

    Attributes:
        request_id: the request.
        status: how it was resolved: committed, dropped or cancelled (a `PrefetchStatus`, which compares
            equal to the strings `"committed"`, `"dropped"`, `"cancelled"`).
        completed_tokens: tokens fully read and verified when streaming stopped.
        matched_tokens: tokens storage reported as present (the prefetch's size).
        loaded_tokens: tokens newly attached to the tree (completed minus those the tree already held).
        released_tokens: host tokens handed back (duplicates, unfetched tail, or everything on drop),
            quarantined ones included.
        failed_pages: pages that failed to read (missing, corrupt, an I/O error or a timeout).
        quarantined_tokens: of `released_tokens`, those a stray read may still write into: held out of
            use and released once its thread returns.
        node: the tree node covering the loaded pages (the anchor when nothing was attached).
        drop_reason: why the pages were dropped (None unless `status` is `PrefetchStatus.DROPPED`).
        rescued: committed only because the attach point's chain was backed up first
            (`RefillPolicy.BACKUP_THEN_ATTACH`); under `drop` it would have been dropped.
    """

    request_id: str
    status: PrefetchStatus
    completed_tokens: int
    matched_tokens: int
    loaded_tokens: int
    released_tokens: int
    failed_pages: int
    node: NodeRef | None = field(repr=False, default=None)
    quarantined_tokens: int = 0
    drop_reason: DropReason | None = None
    rescued: bool = False

    @property
    def committed(self) -> bool:
        """Whether the prefetched pages were attached to the tree."""
        return self.status == PrefetchStatus.COMMITTED

    @property
    def dropped(self) -> bool:
        """Whether the prefetched pages went back without being attached (see `drop_reason`)."""
        return self.status == PrefetchStatus.DROPPED


class Prefetch:
    """One request's storage prefetch: host pages, page keys, and a streaming task's progress.

    Created by `HiCache.prefetch`; the cache runs `stream()` in its task group and resolves it with
    `commit_prefetch` or `cancel_prefetch`.
    """

    def __init__(
        self,
        *,
        request_id: str,
        anchor: NodeRef,
        key: bytes,
        hashes: Sequence[bytes],
        page_keys: Sequence[str],
        host_indices: torch.Tensor,
        page_size: int,
        stop_policy: StopPolicy,
        timeout_s: float,
        transfers: Sequence[ComponentTransfer] = (),
        staged: Sequence[ComponentTransfer] = (),
        staged_reads: Sequence[tuple[Sequence[str], Sequence[memoryview]]] = (),
        ticket: int,
    ) -> None:
        self.request_id = request_id
        self.ticket = ticket
        """Its place in the loop pacer's queue (`LoopPacer.ticket`): older prefetches' turns go first."""
        self.anchor = anchor
        self.key = key
        """Token key of the prefetched pages, continuing from the anchor's end."""
        self.hashes = list(hashes)
        self.page_keys = list(page_keys)
        self.host_indices = host_indices
        self.page_size = page_size
        self.stop_policy = stop_policy
        self.timeout_s = timeout_s
        self.transfers = tuple(transfers) + tuple(staged)
        """Every component transfer of this prefetch: the caller's, then those staged by the cache."""
        self.staged = tuple(staged)
        """The component transfers the cache staged (read from storage after the pages, all or nothing)."""
        self._staged_reads = [(list(keys), list(views)) for keys, views in staged_reads]
        self.components_complete = not self._staged_reads
        """Every staged component page was read and verified (true when none were staged)."""
        self.state = PrefetchState.STREAMING
        self.completed_pages = 0
        self.failed_pages = 0
        self.timed_out_reads = 0
        """Storage reads that did not return within the read timeout (their pages failed)."""
        self.views: Sequence[memoryview] = ()
        """The host page buffers the stream reads into (set by `stream`)."""
        self.failure_reasons: dict[str, int] = {}
        """`failed_pages` by reason: a failed page's `PageStatus` value (`"miss"`, `"corrupt"`,
        `"foreign_page"`, `"old_format"`, `"error"`), or `"error"` for a `get` that raised."""
        self.unusable_keys: list[str] = []
        """Keys whose stored object was read and found corrupt, foreign or of an old format."""
        self.timed_out = False
        """The `timeout` stop policy's deadline passed before the stream finished."""
        self.started_at = time.monotonic()
        self._stop_requested = False
        self._stream_scope: StopScope | None = None
        self._finished = asyncio.Event()
        self._progress = asyncio.Event()

    @property
    def num_tokens(self) -> int:
        """Tokens this prefetch reads (its host allocation)."""
        return int(self.host_indices.numel())

    @property
    def completed_tokens(self) -> int:
        """Tokens fully read and verified so far, a prefix of the prefetch."""
        return self.completed_pages * self.page_size

    @property
    def done(self) -> bool:
        """Streaming has stopped and no I/O can still write into the host pages."""
        return self._finished.is_set()

    def __repr__(self) -> str:
        return (
            f"<Prefetch {self.request_id!r} {self.state.value} {self.completed_tokens}/{self.num_tokens} tokens "
            f"anchor={self.anchor.id} policy={self.stop_policy.value}>"
        )

    async def stream(
        self,
        backend: StorageBackend,
        views: Sequence[memoryview],
        batch_pages: int,
        concurrency: int = 1,
        read_timeout_s: float = math.inf,
    ) -> None:
        """Read pages in batches, up to `concurrency` batches at once, until all are read or one fails.

        A page counts only once fully written and verified, and only after every page before it:
        `completed_pages` is always an exact prefix, however the batches finish. The first failed
        page ends the stream there (batches behind it are cancelled); so does a batch whose `get` does
        not return within `read_timeout_s` (counted in `timed_out_reads`). This returns promptly when
        cancelled through `request_stop`, even while a read is stuck: a backend's cancelled `get` abandons
        its worker threads, and `busy_pages()` then names the pages a stray thread may still write into.
        """
        self.views = views
        total = len(self.page_keys)
        bounds = [(s, min(total, s + batch_pages)) for s in range(0, total, batch_pages)]
        # batch -> (leading verified pages, -1 when the read raised; the first failed page's reason)
        finished: dict[int, tuple[int, str]] = {}
        next_batch = 0  # the first batch not settled yet
        next_read = 0  # the first batch no reader has taken yet

        def settle(readers: StopScope) -> None:
            nonlocal next_batch
            while next_batch in finished:
                start, stop = bounds[next_batch]
                good, reason = finished.pop(next_batch)
                self.completed_pages = start + max(good, 0)
                self._notify_progress()
                if good < stop - start:
                    self._count_failures(reason, 1)
                    readers.stop()  # the pages behind a failure are useless
                    next_batch = len(bounds)
                    return
                next_batch += 1

        async def read(index: int, readers: StopScope) -> None:
            start, stop = bounds[index]
            reason = "error"
            try:
                async with StopScope(read_timeout_s) as deadline:
                    ok = await backend.get(self.page_keys[start:stop], views[start:stop])
                if deadline.cut_short:
                    logger.warning(
                        "prefetch %s: storage read of pages %d-%d timed out after %.3gs",
                        self.request_id,
                        start,
                        stop - 1,
                        read_timeout_s,
                    )
                    self.timed_out_reads += 1
                    good, reason = -1, "timeout"
                elif ok.count(PageStatus.HIT) == len(ok):  # the common case, without a look at each page
                    good = len(ok)
                else:
                    good = next((i for i, flag in enumerate(ok) if not flag), len(ok))
                    if good < len(ok):
                        reason = _reason(ok[good])
                        self._note_unusable(self.page_keys[start:stop], ok)
            except Exception as exc:  # a storage error ends the prefetch here, never the loop
                logger.warning("prefetch %s: storage read failed: %r", self.request_id, exc)
                good = -1
            finished[index] = (good, reason)
            settle(readers)

        async def reader(readers: StopScope) -> None:
            # Each of `concurrency` readers takes the next batch as soon as its own read settles: no task
            # spawned and no semaphore handed on per batch (each cost the loop an iteration, issue 12).
            nonlocal next_read
            while next_read < len(bounds) and next_batch < len(bounds):
                if readers.stopped or self._stop_requested:  # a stopped stream starts no new read
                    return
                index, next_read = next_read, next_read + 1
                await read(index, readers)

        try:
            async with StopScope() as scope:
                self._stream_scope = scope
                if self._stop_requested:
                    scope.stop()
                readers_needed = min(max(1, concurrency), len(bounds))
                async with StopScope() as readers:
                    if readers_needed == 1:  # one reader reads in this task: no task, no group to join
                        await reader(readers)
                    else:
                        async with asyncio.TaskGroup() as tg:
                            for _ in range(readers_needed):
                                tg.create_task(reader(readers))
                if self.completed_pages == total and self._staged_reads:
                    await self._read_components(backend, read_timeout_s)
                if self.unusable_keys:
                    await self._remove_unusable(backend, read_timeout_s)
        finally:
            self._stream_scope = None
            if self.state is PrefetchState.STREAMING:
                self.state = PrefetchState.TERMINATED
            self._finished.set()
            self._notify_progress()

    async def _read_components(self, backend: StorageBackend, read_timeout_s: float) -> None:
        """Read the staged component pages; complete only if every one of them arrives."""
        for keys, views in self._staged_reads:
            try:
                async with StopScope(read_timeout_s) as deadline:
                    ok = await backend.get(keys, views)
                if deadline.cut_short:
                    logger.warning("prefetch %s: component read timed out", self.request_id)
                    self.timed_out_reads += 1
                    self._count_failures("timeout", 1)
                    return
            except Exception as exc:  # as for pages: a storage error ends the prefetch, never the loop
                logger.warning("prefetch %s: component read failed: %r", self.request_id, exc)
                self._count_failures("error", 1)
                return
            if not all(ok):
                for status in ok:
                    if not status:
                        self._count_failures(_reason(status), 1)
                self._note_unusable(keys, ok)
                return
        self.components_complete = True

    def busy_pages(self, start: int = 0) -> list[bool]:
        """One flag per host page from page `start` on: may a stray read still write into it."""
        return stray_threads.busy_flags(self.views[start:])

    def staged_views(self) -> list[Sequence[memoryview]]:
        """The buffers of each staged component transfer (aligned with `staged`)."""
        return [views for _, views in self._staged_reads]

    def _note_unusable(self, keys: Sequence[str], statuses: Sequence[object]) -> None:
        self.unusable_keys.extend(k for k, s in zip(keys, statuses, strict=True) if s in _UNUSABLE)

    async def _remove_unusable(self, backend: StorageBackend, timeout_s: float) -> None:
        """Delete the stored objects that can never load under this namespace's keys (`unusable_keys`), so
        the next write-through of their path puts the real pages back instead of finding the keys taken
        for good. Part of the stream (a commit waits for it), bounded by the read timeout. A failure or a
        timeout only leaves them in place."""
        try:
            async with StopScope(timeout_s):
                await backend.delete(self.unusable_keys)
        except Exception as exc:
            logger.warning("prefetch %s: cannot remove unusable pages: %r", self.request_id, exc)

    def _count_failures(self, reason: str, pages: int) -> None:
        self.failed_pages += pages
        self.failure_reasons[reason] = self.failure_reasons.get(reason, 0) + pages

    def request_stop(self) -> None:
        """Ask the stream to stop now; pages already verified stay counted."""
        self._stop_requested = True
        if self._stream_scope is not None:
            self._stream_scope.stop()

    async def wait_stopped(self) -> None:
        """Wait until streaming has stopped and no I/O is in flight."""
        await self._finished.wait()

    async def wait_for_stop_policy(self) -> None:
        """Wait as long as the stop policy says before a commit terminates the stream."""
        if self.stop_policy is StopPolicy.BEST_EFFORT:
            return
        if self.stop_policy is StopPolicy.WAIT_COMPLETE:
            await self._finished.wait()
            return
        remaining = self.started_at + self.timeout_s - time.monotonic()
        if remaining > 0:
            async with StopScope(remaining):
                await self._finished.wait()
        if not self._finished.is_set():
            self.timed_out = True

    async def wait_progress(self) -> None:
        """Wait until more pages complete or the stream stops (for serving loops that poll progress)."""
        if self._finished.is_set():
            return
        await self._progress.wait()

    def _notify_progress(self) -> None:
        self._progress.set()
        self._progress = asyncio.Event()


_COMPLETE = 1 << 40
"""Added to a commit decision's pages when this rank has every staged component (see `_stop_and_agree`)."""

_STOP_GRACE_S = 1.0
"""How long `cancel` waits for a stream to stop before resolving it detached. A stream stops within a few
event-loop turns (a cancelled read abandons its threads); this only bounds a backend that does not honour
cancellation."""


class Prefetches:
    """The prefetches in flight, from their launch (`launch`, by admission) to commit, drop or cancel.

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
        self._prefetches: dict[str, Prefetch] = {}
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

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._prefetches

    @property
    def detached(self) -> int:
        """Cancelled prefetches whose stream is still stopping."""
        return len(self._detached)

    def all_in_flight(self) -> Iterator[Prefetch]:
        """Every prefetch that still holds pages: those in flight and the detached ones."""
        yield from self._prefetches.values()
        yield from self._detached

    def launch(self, prefetch: Prefetch, storage: GuardedStorage) -> None:
        """Take `prefetch` (admitted, its pages allocated) in flight and spawn its stream."""
        spawn = self.spawn
        assert spawn is not None  # admission checked the cache is open after its last await
        request_id = prefetch.request_id
        self._prefetches[request_id] = prefetch
        # Proposed where every rank launches it: right after admission.
        self._commits[request_id] = self._agreement.propose("commit", request_id)
        self.inflight_tokens += prefetch.num_tokens
        self._metrics.prefetch_hit_tokens.inc(prefetch.num_tokens)
        spawn(self._stream, prefetch, storage)

    async def _stream(self, prefetch: Prefetch, storage: GuardedStorage) -> None:
        try:
            views = self._host_pool.page_views(prefetch.host_indices)
            # Views and the first reads' submission are separate loop iterations (issue 12); the stream
            # takes no turn of the pacer: its prefetch took its one turn on the way down at `start`.
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
        agreed_pages, components_complete, cancelled = await self._stop_and_agree(prefetch)
        # The ranks' decision is out of the agreement: the commit is carried out whole, in this task (a
        # cancellation meanwhile is re-raised once it is). Before this point a cancellation undid
        # everything.
        try:
            self._check_still_in_flight(request_id, prefetch)
            rescued = False
            if self.rescue is not None and not prefetch.staged:
                # Before the atomic part: back up what the refill would hang from (see `RefillRescue`),
                # in a task of its own that a cancellation does not cut short.
                agreed_tokens = min(prefetch.completed_tokens, agreed_pages * self._page_size)
                rescued, late = await carried_out(self.rescue.prepare(prefetch, agreed_tokens))
                cancelled = cancelled or late
                self._check_still_in_flight(request_id, prefetch)
            # Prefetches that stop together commit in loop iterations of their own. A cancellation gives
            # the turn up, never the commit.
            try:
                await self.pacer.turn(prefetch.ticket)
            except asyncio.CancelledError as exc:
                cancelled = cancelled or exc
            self._check_still_in_flight(request_id, prefetch)
        except Exception:
            if cancelled is not None:  # the caller's cancellation says more than what it left behind
                raise cancelled from None
            raise
        outcome = self._carry_out(request_id, prefetch, agreed_pages, components_complete, rescued)
        if cancelled is not None:
            raise cancelled
        return outcome

    def _carry_out(
        self,
        request_id: str,
        prefetch: Prefetch,
        agreed_pages: int,
        components_complete: bool,
        rescued: bool,
    ) -> PrefetchOutcome:
        """The commit's atomic part: the outcome, decided and carried out with no await."""
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
        cache_logger.info(
            "prefetch %s request=%s completed=%d matched=%d loaded=%d released=%d",
            outcome.status.value,
            request_id,
            completed,
            outcome.matched_tokens,
            loaded,
            outcome.released_tokens,
        )
        return outcome

    async def _stop_and_agree(self, prefetch: Prefetch) -> tuple[int, bool, asyncio.CancelledError | None]:
        """Wait for the stop policy and the stream to stop, and agree the pages completed (the minimum
        over the ranks; this rank keeps stepping while it waits) and whether every rank has its staged
        components: (pages, complete, the cancellation to re-raise once the commit is carried out: one
        that came after the ranks agreed, e.g. between the decision's resolving and its waiter's wake-up).
        A cancellation before the agreement propagates, the prefetch left in flight."""

        async def stop() -> int:
            await prefetch.wait_for_stop_policy()
            prefetch.request_stop()
            await prefetch.wait_stopped()  # prompt: a cancelled read abandons its threads
            # Staged components are all or nothing: a rank missing one has no usable page (every rank
            # then drops the prefetch, `COMPONENT_INCOMPLETE`). Complete ranks count above any other.
            return prefetch.completed_pages + (_COMPLETE if prefetch.components_complete else 0)

        decision = self._commits.pop(prefetch.request_id)
        cancelled: asyncio.CancelledError | None = None
        try:
            agreed = await self._agreement.agree_on(decision, stop)
        except asyncio.CancelledError as exc:
            if decision.result is None:
                self._commits.setdefault(prefetch.request_id, decision)  # still in flight: commit again
                raise
            agreed, cancelled = decision.result, exc  # decided on every rank: carried out, then re-raised
        except BaseException:
            self._commits.setdefault(prefetch.request_id, decision)  # still in flight: commit again
            raise
        return agreed % _COMPLETE, agreed >= _COMPLETE, cancelled

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
        cache_logger.info(
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
            cache_logger.warning(
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
