"""Batching and bounded concurrency for storage backends, in one place.

Backends write per-object (or per-group) primitives; `gather_bounded` runs them under a limit and, on the
first failure, cancels and awaits the siblings before re-raising (the shape of fsspec's
`_run_coros_in_chunks`, built on an asyncio task group). The rest are small helpers every backend needs for
per-page results: argument checks, grouping pages into worker-thread calls, and the statistics record.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import compress
from operator import attrgetter
from typing import TypeVar, cast

from storage_backends.protocol import PageStatus
from storage_backends.threads import WorkerThreads

__all__ = [
    "CORRUPT",
    "ERROR",
    "FOREIGN",
    "HIT",
    "MISS",
    "OLD_FORMAT",
    "BackendStatistics",
    "StatisticsRecorder",
    "buffer_sizes",
    "check_batch",
    "check_keys",
    "gather_bounded",
    "gather_page_groups",
    "group_slices",
]

T = TypeVar("T")

HIT = PageStatus.HIT
"""Per-page outcome: the page was read (or written) and verified."""
MISS = PageStatus.MISS
"""Per-page outcome: the page is absent."""
CORRUPT = PageStatus.CORRUPT
"""Per-page outcome: the page is truncated, has a bad header or fails its checksum."""
FOREIGN = PageStatus.FOREIGN
"""Per-page outcome: the page's header names another namespace or key."""
OLD_FORMAT = PageStatus.OLD_FORMAT
"""Per-page outcome: the page is of another page format version."""
ERROR = PageStatus.ERROR
"""Per-page outcome: the I/O failed for another reason."""

_PENDING = object()
_NBYTES = attrgetter("nbytes")


async def gather_bounded(funcs: Sequence[Callable[[], Awaitable[T]]], limit: int) -> list[T]:
    """Await every `funcs[i]()` with at most `limit` running at once; results in the order of `funcs`.

    On the first exception the remaining calls are cancelled (and those not started never start), every
    sibling is awaited, then that first exception is re-raised as itself (not wrapped in a group). A
    sibling cancelled while its worker thread ran leaves that thread registered in `stray_threads` (see
    `storage_backends.threads`). Cancellation from outside propagates untouched.

    `min(limit, len(funcs))` worker tasks pull the next call from a shared cursor, instead of one task per
    call queueing on a `CapacityLimiter`: same bound, but a batch of 16k pages costs 16 tasks, not 16k.

    Args:
        funcs: zero-argument callables returning awaitables (e.g. `functools.partial(read_one, key)`).
        limit: the most calls in flight at once (>= 1).

    Raises:
        ValueError: if `limit` < 1.
    """
    if limit < 1:
        raise ValueError(f"limit: expected >= 1, got {limit}")
    n = len(funcs)
    if n == 0:
        return []
    if n == 1:
        return [await funcs[0]()]
    results: list[object] = [_PENDING] * n
    cursor = iter(range(n))

    async def worker() -> None:
        for i in cursor:
            results[i] = await funcs[i]()

    # The first failure cancels the siblings (the task group does that) and is what propagates.
    try:
        async with asyncio.TaskGroup() as tg:
            for _ in range(min(limit, n)):
                tg.create_task(worker())
    except ExceptionGroup as group:
        raise group.exceptions[0] from None
    assert all(r is not _PENDING for r in results), "gather_bounded finished with unfinished calls"
    return cast("list[T]", results)


def check_batch(keys: Sequence[str], buffers: Sequence[memoryview]) -> None:
    """Check a get/put batch before any I/O starts.

    Raises:
        ValueError: naming `buffers`, if the lengths of `keys` and `buffers` differ or a buffer is not a
            C-contiguous memoryview.
        TypeError: naming `keys`, if `keys` is a single `str` instead of a sequence of keys.
    """
    check_keys(keys)
    if len(keys) != len(buffers):
        raise ValueError(f"buffers: expected one buffer per key ({len(keys)}), got {len(buffers)}")
    if all(type(buf) is memoryview and buf.c_contiguous for buf in buffers):
        return
    for i, buf in enumerate(buffers):
        if not isinstance(buf, memoryview):
            raise ValueError(f"buffers[{i}]: expected a memoryview, got {type(buf).__name__}")
        if not buf.c_contiguous:
            raise ValueError(f"buffers[{i}]: expected a C-contiguous memoryview")


def check_keys(keys: Sequence[str]) -> None:
    """Check that `keys` is a sequence of keys, not one key.

    Raises:
        TypeError: naming `keys`, if `keys` is a single `str` instead of a sequence of keys.
    """
    if isinstance(keys, str):
        raise TypeError("keys: expected a sequence of page keys, got a single str")


def buffer_sizes(buffers: Sequence[memoryview]) -> list[int]:
    """`nbytes` of every buffer (a C-level map: cheap on the event loop even for 16k pages)."""
    return list(map(_NBYTES, buffers))


def group_slices(
    sizes: Sequence[int], *, limit: int, group_bytes: int, min_group_bytes: int = 0
) -> list[slice]:
    """Split a batch into contiguous groups, one worker-thread call each.

    Small pages are grouped so one thread hop (tens of microseconds of event-loop time) is spread over
    several pages; a group never exceeds `group_bytes` unless a single page does. A batch with at least
    `limit` pages is split into at least `limit` groups, so every permitted thread has work, but only
    while each group keeps `min_group_bytes`: a small batch is not scattered over threads page by page
    when one hop would cost more than the pages it carries.

    Args:
        sizes: bytes per page, in batch order.
        limit: the concurrency the groups will run under.
        group_bytes: the target bytes per group.
        min_group_bytes: the fewest bytes worth a group of its own when spreading over `limit` threads.
    """
    n = len(sizes)
    if n == 0:
        return []
    per_thread = math.ceil(n / max(1, limit))
    size = sizes[0]
    if size > 0 and min(sizes) == max(sizes) == size:
        # Pages of one size (a KV pool's, always): every group is the same length, found by arithmetic,
        # not by a Python loop over the pages on the event loop (~40 us per 256-page batch). The length is
        # where the loop below would cut: the first that would pass `group_bytes` with one more page, or
        # that reaches `per_thread` pages and `min_group_bytes` bytes, whichever comes first.
        length = min(max(1, group_bytes // size), max(1, per_thread, -(-min_group_bytes // size)))
        return [slice(start, min(start + length, n)) for start in range(0, n, length)]
    return _cut_page_by_page(sizes, per_thread, group_bytes, min_group_bytes)


def _cut_page_by_page(
    sizes: Sequence[int], per_thread: int, group_bytes: int, min_group_bytes: int
) -> list[slice]:
    """`group_slices`' rule, page by page: cut before a page that would take the group past `group_bytes`,
    or once it has `per_thread` pages and `min_group_bytes` bytes."""
    out: list[slice] = []
    start = 0
    acc = 0
    for i, size in enumerate(sizes):
        if i > start and (acc + size > group_bytes or (i - start >= per_thread and acc >= min_group_bytes)):
            out.append(slice(start, i))
            start, acc = i, 0
        acc += size
    out.append(slice(start, len(sizes)))
    return out


async def gather_page_groups(
    func: Callable[[Sequence[str], Sequence[memoryview]], list[PageStatus]],
    keys: Sequence[str],
    buffers: Sequence[memoryview],
    *,
    workers: WorkerThreads,
    group_bytes: int,
    min_group_bytes: int = 0,
) -> list[PageStatus]:
    """Run `func(keys[g], buffers[g])` in `workers` over the `group_slices` of a batch.

    The batch is spread over the threads of `workers` that no other job claims (`WorkerThreads.unclaimed`,
    see `group_slices`); every group is a job of `workers` (`WorkerThreads.calls`: a thread outlives the
    call only when the call is cancelled, and is then registered with its group's buffers in
    `stray_threads`). An exception is raised once every group returned.

    Returns:
        The per-page outcome codes `func` returned, flattened, in batch order.
    """
    groups = group_slices(
        buffer_sizes(buffers),
        limit=workers.unclaimed,
        group_bytes=group_bytes,
        min_group_bytes=min_group_bytes,
    )
    outcomes = await workers.calls(
        [partial(func, keys[g], buffers[g]) for g in groups], [buffers[g] for g in groups]
    )
    return [o for group in outcomes for o in group]


@dataclass(frozen=True, slots=True)
class BackendStatistics:
    """A snapshot of a backend's counters since it was opened.

    Attributes:
        pages_read: pages `get` loaded and verified.
        pages_written: pages `put` stored.
        bytes_read: payload bytes of `pages_read`.
        bytes_written: payload bytes of `pages_written`.
        misses: pages `get` found absent.
        checksum_failures: pages `get` found truncated, with a bad header, or failing their checksum.
        errors: pages whose I/O failed for another reason (permission, disk full, I/O error).
        foreign_pages: pages `get` found verifying but naming another namespace or key in their header.
        old_format_pages: pages `get` found in another page format version.
    """

    pages_read: int = 0
    pages_written: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    misses: int = 0
    checksum_failures: int = 0
    errors: int = 0
    foreign_pages: int = 0
    old_format_pages: int = 0


class StatisticsRecorder:
    """The mutable counters behind `BackendStatistics`; updated on the event loop thread only.

    Worker threads return per-page `PageStatus` outcomes; the backend tallies them here after the thread
    call returns, so no lock is needed.
    """

    __slots__ = (
        "bytes_read",
        "bytes_written",
        "checksum_failures",
        "errors",
        "foreign_pages",
        "misses",
        "old_format_pages",
        "pages_read",
        "pages_written",
    )

    def __init__(self) -> None:
        self.pages_read = 0
        self.pages_written = 0
        self.bytes_read = 0
        self.bytes_written = 0
        self.misses = 0
        self.checksum_failures = 0
        self.errors = 0
        self.foreign_pages = 0
        self.old_format_pages = 0

    def record_reads(self, outcomes: list[PageStatus], buffers: Sequence[memoryview]) -> list[PageStatus]:
        """Tally the outcomes of reads into `buffers`; return them (one `PageStatus` per page)."""
        # Counted with C-level builtins: a 16k-page batch costs well under a millisecond of loop time.
        hits = outcomes.count(HIT)
        self.pages_read += hits
        if hits == len(outcomes):
            self.bytes_read += sum(map(_NBYTES, buffers))
            return outcomes
        self.bytes_read += sum(map(_NBYTES, compress(buffers, [o is HIT for o in outcomes])))
        self.record_failures(outcomes)
        return outcomes

    def record_failures(self, outcomes: Sequence[PageStatus]) -> None:
        """Count the failed reads among `outcomes` by reason (hits are left to the caller)."""
        self.misses += outcomes.count(MISS)
        self.checksum_failures += outcomes.count(CORRUPT)
        self.errors += outcomes.count(ERROR)
        self.foreign_pages += outcomes.count(FOREIGN)
        self.old_format_pages += outcomes.count(OLD_FORMAT)

    def record_writes(self, outcomes: list[PageStatus], buffers: Sequence[memoryview]) -> list[bool]:
        """Tally the outcomes of writes from `buffers`; return one success flag per page."""
        flags = [o == HIT for o in outcomes]
        hits = flags.count(True)
        self.pages_written += hits
        self.bytes_written += sum(map(_NBYTES, compress(buffers, flags)))
        self.errors += len(flags) - hits
        return flags

    def counters(self) -> dict[str, int]:
        """The counters by `BackendStatistics` field name (for a subclass's snapshot to extend)."""
        return {
            "pages_read": self.pages_read,
            "pages_written": self.pages_written,
            "bytes_read": self.bytes_read,
            "bytes_written": self.bytes_written,
            "misses": self.misses,
            "checksum_failures": self.checksum_failures,
            "errors": self.errors,
            "foreign_pages": self.foreign_pages,
            "old_format_pages": self.old_format_pages,
        }

    def snapshot(self) -> BackendStatistics:
        """The counters as a frozen `BackendStatistics`."""
        return BackendStatistics(**self.counters())
