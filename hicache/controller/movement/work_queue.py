"""A bounded FIFO of background jobs run by one worker task, in batches, with an idle signal for `wait_idle`.

Backpressure: a queue holds at most `limit` items. `put` refuses what does not fit, newest first, and
returns it for the caller to count (`writes_shed_total`). Newest-first shedding keeps the queue's order:
work accepted earlier is never dropped for work that came later, so when a chain's root was queued before
its descendants, the root is written first (a prefetch can only hit a prefix of pages: a descendant stored
without its root is unreachable). It is also cheap to lose: the next insert that extends the same path
queues the path again, and backup and write-through both cover a target's whole un-backed path.

Throughput: the worker takes up to `max_batch` items per job call, so one thread hop (a copy, a storage
put) serves every request that queued work meanwhile; a saturated event loop then still drains the queue
instead of giving the worker one item per turn. The producer gives the worker its turns (`wait_below`;
see `HiCache.insert`): a serving task that never suspends would otherwise never let it run at all.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from typing import Generic, TypeVar

__all__ = ["WorkQueue"]

T = TypeVar("T")

logger = logging.getLogger("hicache.work")


class WorkQueue(Generic[T]):
    """Jobs are queued without awaiting and run in order by `run()`; a failing job is logged, not fatal.

    Args:
        name: what the jobs are, for logs and reprs.
        job: the coroutine function run once per batch of items (in queue order).
        limit: the most items queued at once (None: unbounded).
        max_batch: the most items handed to one `job` call.
        on_drop: called with the items `close()` drops unrun (to let go of what they hold).

    Raises:
        ValueError: naming `limit` or `max_batch` when below 1.
    """

    def __init__(
        self,
        name: str,
        job: Callable[[list[T]], Awaitable[object]],
        *,
        limit: int | None = None,
        max_batch: int = 1,
        on_drop: Callable[[list[T]], object] | None = None,
    ) -> None:
        if limit is not None and limit < 1:
            raise ValueError(f"limit: expected >= 1 or None, got {limit}")
        if max_batch < 1:
            raise ValueError(f"max_batch: expected >= 1, got {max_batch}")
        self.name = name
        self.limit = limit
        self.max_batch = max_batch
        self._job = job
        self._on_drop = on_drop
        self._items: deque[T] = deque()
        self._unfinished = 0
        self._max_queued = 0
        self._wakeup = asyncio.Event()
        self._taken = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._closed = False

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return (
            f"<WorkQueue {self.name} queued={len(self._items)}/{self.limit} unfinished={self._unfinished} "
            f"max_queued={self._max_queued}>"
        )

    @property
    def idle(self) -> bool:
        """No job is queued or running."""
        return self._unfinished == 0

    def close(self) -> int:
        """Drop every queued job and refuse new ones; `wait_idle` and `wait_below` return from now on.
        Returns the dropped count. A job already running finishes (or is cancelled) in its worker."""
        dropped = len(self._items)
        items = list(self._items)
        self._items.clear()
        self._unfinished -= dropped
        self._closed = True
        self._idle.set()
        self._taken.set()
        if dropped:
            logger.info("%s: %d queued job(s) dropped on close", self.name, dropped)
            if self._on_drop is not None:
                self._on_drop(items)
        return dropped

    @property
    def accepting(self) -> bool:
        """`put` queues work (the queue is not closed)."""
        return not self._closed

    @property
    def max_queued(self) -> int:
        """The most items ever queued at once (a high-water mark; never above `limit`)."""
        return self._max_queued

    def put(self, items: Iterable[T]) -> list[T]:
        """Queue jobs; never awaits. Returns the items refused because the queue is full (the newest).
        Once closed, nothing is queued (and nothing counts as shed)."""
        shed: list[T] = []
        if self._closed:
            return shed
        added = 0
        for item in items:
            if self.limit is not None and len(self._items) >= self.limit:
                shed.append(item)
                continue
            self._items.append(item)
            added += 1
        if not added:
            return shed
        self._max_queued = max(self._max_queued, len(self._items))
        if self._unfinished == 0:
            self._idle = asyncio.Event()
        self._unfinished += added
        self._wakeup.set()
        return shed

    async def wait_idle(self) -> None:
        """Wait until every queued job has finished."""
        await self._idle.wait()

    async def wait_below(self, n: int) -> None:
        """Wait until at most `n` items are queued (the worker took the rest)."""
        while len(self._items) > n:
            if self._taken.is_set():
                self._taken = asyncio.Event()
            await self._taken.wait()

    async def run(self) -> None:
        """The worker: runs queued jobs, up to `max_batch` items per call, until cancelled."""
        while True:
            await self._wakeup.wait()
            self._wakeup = asyncio.Event()
            while self._items:
                batch = [self._items.popleft() for _ in range(min(self.max_batch, len(self._items)))]
                self._taken.set()
                try:
                    await self._job(batch)
                except Exception:
                    logger.exception(
                        "%s job failed for %d item(s), first %r", self.name, len(batch), batch[0]
                    )
                finally:
                    self._unfinished -= len(batch)
                    if self._unfinished == 0 or self._closed:
                        self._idle.set()
