"""What asyncio's cancellation lacks, in one place: work a cancellation never abandons, a thread call that
waits for its thread, and a scope another task (or a deadline) can stop quietly.

hicache runs on asyncio and its callers cancel with asyncio (`asyncio.timeout`, `wait_for`,
`Task.cancel`), so asyncio is its one cancellation vocabulary. Three things asyncio has no word for:

- `uncancellable(work)`: await `work` to its end even if the caller is cancelled meanwhile, then re-raise
  the cancellation (asyncio's `shield` alone ends the caller's wait at once and leaves the work running);
  `carried_out(work)` hands the cancellation back with the result instead, to a caller with more to do.
- `run_in_thread(func, *args)`: `func` in a worker thread; the caller's wait ends only once the thread
  returned, so no thread still writes into a buffer the caller frees on its way out (`asyncio.to_thread`
  alone returns on cancellation while its thread runs on).
- `StopScope`: a body that `stop()` or a deadline cuts short, after which it exits quietly (an
  `asyncio.timeout` that raises nothing and can be stopped by another task).

It imports nothing of hicache's, so the storage backends and the cache can both use it.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import math
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import TypeVar

__all__ = ["StopScope", "carried_out", "run_in_thread", "uncancellable"]

T = TypeVar("T")


async def uncancellable(work: Awaitable[T], *, on_cancel: Callable[[], object] | None = None) -> T:
    """Await `work` to its end, absorbing the caller's cancellations meanwhile; then re-raise the first.

    `work` runs in a task of its own (a future is awaited as it is), which the caller's cancellation never
    cancels: the caller's wait ends only once `work` has ended. If the caller was cancelled meanwhile, that
    cancellation propagates (whatever `work` returned or raised, which is retrieved); otherwise `work`'s
    result or exception is the caller's. For short work that must never be abandoned: a copy into a buffer
    the caller frees on its way out, a decision that must be carried out whole. `on_cancel`, if given, is
    called at the caller's first cancellation (to ask the work to end early, e.g. a copy to stop at its
    next layer).
    """
    result, cancelled = await carried_out(work, on_cancel=on_cancel)
    if cancelled is not None:
        raise cancelled
    return result


async def carried_out(
    work: Awaitable[T], *, on_cancel: Callable[[], object] | None = None
) -> tuple[T, asyncio.CancelledError | None]:
    """`uncancellable`, for a caller that goes on after `work` even when cancelled meanwhile: `work`'s
    result and the caller's first cancellation (None if none came), which the caller re-raises when it
    is done. If `work` raised, that propagates, unless the caller was cancelled: then the cancellation
    does (and `work`'s exception is retrieved)."""
    task = asyncio.ensure_future(work)
    cancelled: asyncio.CancelledError | None = None
    while not task.done():
        try:
            await asyncio.wait((task,))
        except asyncio.CancelledError as exc:
            if cancelled is None:
                cancelled = exc
                if on_cancel is not None:
                    on_cancel()
    if cancelled is not None and (task.cancelled() or task.exception() is not None):
        raise cancelled  # whatever `work` raised is retrieved: never logged as "never retrieved"
    return task.result(), cancelled


async def run_in_thread(
    func: Callable[..., T], /, *args: object, limiter: asyncio.Semaphore | None = None
) -> T:
    """`func(*args)` in the event loop's default executor, in a copy of the caller's context.

    A cancellation while waiting for `limiter` (a bound on how many such calls run at once) ends the call
    before it starts; one while the thread runs is held off until the thread returned, then re-raised: when
    this returns, normally or not, the thread is done with every buffer it was handed.
    """
    loop = asyncio.get_running_loop()
    call = functools.partial(contextvars.copy_context().run, func, *args)
    if limiter is None:
        return await uncancellable(loop.run_in_executor(None, call))
    async with limiter:
        return await uncancellable(loop.run_in_executor(None, call))


class StopScope:
    """An `async with` body that `stop()` or a deadline cuts short, after which the body exits quietly.

    Args:
        delay: seconds from entering until the body is cut short (None: no deadline).

    The body is cancelled at its next await once the deadline passes or `stop()` is called (from any task
    of the loop, before or during the body); the cancellation is caught at the scope's end, and `cut_short`
    says so. Any other exception, a `TimeoutError` the body raised itself included, propagates as it is;
    so does a cancellation from outside the scope.
    """

    def __init__(self, delay: float | None = None) -> None:
        if delay is not None and (not isinstance(delay, (int, float)) or math.isnan(delay)):
            raise TypeError(f"delay must be a number of seconds or None, got {delay!r}")
        self._delay = delay
        self._timeout: asyncio.Timeout | None = None
        self._inside = False
        self.stopped = False
        """Whether `stop()` was called."""
        self.cut_short = False
        """Whether the body was cancelled by this scope (its deadline or `stop()`) and exited early."""

    def stop(self) -> None:
        """Cut the body short at its next await (idempotent; before entering: at once on entry)."""
        self.stopped = True
        if self._inside and self._timeout is not None and not self._timeout.expired():
            self._timeout.reschedule(asyncio.get_running_loop().time())

    async def __aenter__(self) -> StopScope:
        loop = asyncio.get_running_loop()
        when = None if self._delay is None or math.isinf(self._delay) else loop.time() + self._delay
        self._timeout = asyncio.timeout_at(loop.time() if self.stopped else when)
        await self._timeout.__aenter__()
        self._inside = True
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        assert self._timeout is not None
        self._inside = False
        try:
            await self._timeout.__aexit__(exc_type, exc, tb)
        except TimeoutError:
            if not self._timeout.expired():
                raise
            self.cut_short = True
            return True
        return False
