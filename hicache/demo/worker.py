"""The demo's model thread: one thread runs every forward pass, round-robin, never waiting for the loop.

The serving loop used to run each model call (a prefill, one decode step) in a worker thread under an
`anyio.Lock`: the lock was released only once the event loop resumed the awaiting coroutine, so every
decode step held the model for as long as the loop took to come back to it. With the cache, the loop is
also the cache's (acquires, inserts, backups, storage writes), and on a loaded two-core machine it came
back milliseconds late per step: the model sat idle, locked, nine times per request, on the time to first
token of everyone queued behind it. That cost was the cache's alone (the no-cache run's loop is idle), so
under load the cached run lost its lead (hybrid demo TTFT ratio 1.2 at load 6 to 8).

`ModelWorker` is a model server's scheduler in miniature: calls queue in one thread-safe FIFO; the thread
runs the next call, or the next step of a call cut into steps (a decode) and puts that call back at the
end of the queue, so a prefill that arrives meanwhile waits for one step of each running decode, as
before. The loop only hears when a call is done (`call_soon_threadsafe`), and the model never waits for
it.

The queue is bounded: at most `max_calls` calls are in the worker at once (queued, running, or a decode
between its steps), and a submitter past that waits on the loop for one to end (backpressure; cancellable
while it waits, and nothing is queued then). A call in the worker never waits for a slot (a decode puts
itself back into the slot it holds), so every admitted call runs to its end and frees its slot: `close`
lets them, and a submitter still waiting then is refused.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

import torch

from hicache.demo.model import Steps
from storage_backends.cancellation import uncancellable

__all__ = ["ModelWorker"]

T = TypeVar("T")


@dataclass(eq=False)
class _Job(Generic[T]):
    """One call queued for the model thread: `fn`, or a call cut into `steps`."""

    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[T]
    fn: Callable[[], T] | None = None
    steps: Steps[T] | None = None


class ModelWorker:
    """Runs model calls in one thread of its own, in arrival order, decodes interleaved step by step.

    Args:
        torch_threads: intra-op threads for the thread's forward passes (`None` leaves torch's setting).
        max_calls: calls in the worker at once (queued or running); a submitter past it waits.

    Raises:
        ValueError: `max_calls` is not an int >= 1.
    """

    def __init__(self, torch_threads: int | None, max_calls: int = 64) -> None:
        if isinstance(max_calls, bool) or not isinstance(max_calls, int) or max_calls < 1:
            raise ValueError(f"max_calls: expected an int >= 1, got {max_calls!r}")
        self._torch_threads = torch_threads
        self.max_calls = max_calls
        self._slots = asyncio.Semaphore(max_calls)  # on the submitters' loop: held from admission to result
        self._admitted = 0
        self._jobs: deque[_Job[Any]] = deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def waiting(self) -> int:
        """Calls queued for the model thread (not the one it runs now, nor submitters waiting for room)."""
        with self._cond:
            return len(self._jobs)

    @property
    def closed(self) -> bool:
        """Whether `close` was called (every call submitted from then on is refused)."""
        return self._closed

    @property
    def admitted(self) -> int:
        """Calls in the worker (queued or running; at most `max_calls`)."""
        return self._admitted

    async def call(self, fn: Callable[[], T]) -> T:
        """Run `fn()` in the model thread and return its result (waiting for it even if cancelled)."""
        return await self._submit(fn, None)

    async def steps(self, steps: Steps[T]) -> T:
        """Run a call cut into steps (a decode), one step per turn of the model thread; return its result."""
        return await self._submit(None, steps)

    async def _submit(self, fn: Callable[[], T] | None, steps: Steps[T] | None) -> T:
        if self._closed:
            raise RuntimeError("the model worker is closed")
        # Room: no extra turn of the loop; else backpressure (cancellable, nothing queued yet).
        await self._slots.acquire()
        self._admitted += 1
        try:
            loop = asyncio.get_running_loop()
            job: _Job[T] = _Job(loop, loop.create_future(), fn, steps)
            with self._cond:
                if self._closed:  # closed while this call waited for room
                    raise RuntimeError("the model worker is closed")
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._serve, name="hicache-demo-model", daemon=True
                    )
                    self._thread.start()
                self._jobs.append(job)
                self._cond.notify()
            # The model is never abandoned mid-call: a cancelled caller waits for its call to return.
            return await uncancellable(job.future)
        finally:
            self._admitted -= 1
            self._slots.release()

    def close(self) -> None:
        """Stop the thread once the queued calls ran (idempotent)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join()

    def _serve(self) -> None:
        if self._torch_threads is not None:
            torch.set_num_threads(self._torch_threads)  # per OS thread under OpenMP
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if not self._jobs:
                    return
                job = self._jobs.popleft()
            try:
                if job.steps is None:
                    assert job.fn is not None
                    done, value = True, job.fn()
                else:
                    try:
                        next(job.steps)
                        done, value = False, None
                    except StopIteration as stop:
                        done, value = True, stop.value
            except BaseException as exc:  # handed to the caller, whatever it is
                _hand_back(job, None, exc)
                continue
            if done:
                _hand_back(job, value, None)
            else:
                with self._cond:
                    self._jobs.append(job)  # the rest of the decode, after whatever arrived meanwhile


def _hand_back(job: _Job[Any], value: object, error: BaseException | None) -> None:
    """In the model thread: have the job's loop settle its future. A loop already closed (its caller is
    gone) gets nothing: the thread goes on serving the other loops' calls instead of dying with it."""
    try:
        job.loop.call_soon_threadsafe(_settle, job.future, value, error)
    except RuntimeError:  # "Event loop is closed"
        if not job.loop.is_closed():
            raise


def _settle(future: asyncio.Future[Any], value: object, error: BaseException | None) -> None:
    """On the loop: resolve a job's future (unless its loop already gave up on it)."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(cast(Any, value))
