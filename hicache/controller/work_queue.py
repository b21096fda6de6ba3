"""A FIFO of background jobs run one at a time by a worker task, with an idle signal for `wait_idle`."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from typing import Generic, TypeVar

import anyio

__all__ = ["WorkQueue"]

T = TypeVar("T")

logger = logging.getLogger("hicache.work")


class WorkQueue(Generic[T]):
    """Jobs are queued without awaiting and run in order by `run()`; a failing job is logged, not fatal.

    Args:
        name: what the jobs are, for logs and reprs.
        job: the coroutine function run once per item.
    """

    def __init__(self, name: str, job: Callable[[T], Awaitable[object]]) -> None:
        self.name = name
        self._job = job
        self._items: deque[T] = deque()
        self._unfinished = 0
        self._wakeup = anyio.Event()
        self._idle = anyio.Event()
        self._idle.set()
        self._closed = False

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"<WorkQueue {self.name} queued={len(self._items)} unfinished={self._unfinished}>"

    @property
    def idle(self) -> bool:
        """No job is queued or running."""
        return self._unfinished == 0

    def close(self) -> int:
        """Drop every queued job and refuse new ones; `wait_idle` returns from now on. Returns the dropped
        count. A job already running finishes (or is cancelled) in its worker."""
        dropped = len(self._items)
        self._items.clear()
        self._unfinished -= dropped
        self._closed = True
        self._idle.set()
        if dropped:
            logger.info("%s: %d queued job(s) dropped on close", self.name, dropped)
        return dropped

    def put(self, items: Iterable[T]) -> None:
        """Queue jobs; never awaits. Ignored once closed."""
        if self._closed:
            return
        before = len(self._items)
        self._items.extend(items)
        added = len(self._items) - before
        if not added:
            return
        if self._unfinished == 0:
            self._idle = anyio.Event()
        self._unfinished += added
        self._wakeup.set()

    async def wait_idle(self) -> None:
        """Wait until every queued job has finished."""
        await self._idle.wait()

    async def run(self) -> None:
        """The worker: runs queued jobs one at a time until cancelled."""
        while True:
            await self._wakeup.wait()
            self._wakeup = anyio.Event()
            while self._items:
                item = self._items.popleft()
                try:
                    await self._job(item)
                except Exception:
                    logger.exception("%s job failed for %r", self.name, item)
                finally:
                    self._unfinished -= 1
                    if self._unfinished == 0 or self._closed:
                        self._idle.set()
