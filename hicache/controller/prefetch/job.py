"""A storage prefetch as an object with a lifecycle: started, streaming, terminated, then committed or dropped.

Pages in flight belong to the prefetch, not to the tree: they are invisible to matching and cannot be
evicted. The anchor node is host-locked for the prefetch's whole life so it cannot be evicted either.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hicache.controller.pages.release import ComponentTransfer
from hicache.policy import StopPolicy
from hicache.tiers import DropReason, PrefetchStatus
from hicache.tree import NodeRef
from storage_backends.cancellation import StopScope
from storage_backends.protocol import PageStatus, StorageBackend
from storage_backends.threads import stray_threads

__all__ = ["Prefetch", "PrefetchOutcome", "PrefetchState"]

logger = logging.getLogger("hicache.prefetch")


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
                async with StopScope() as readers, asyncio.TaskGroup() as tg:
                    for _ in range(min(max(1, concurrency), len(bounds))):
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
