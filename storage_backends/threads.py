"""Storage backends' worker threads: one pool per backend, and the stray threads cancelled calls left behind.

Every blocking call of a backend runs in its `WorkerThreads`: at most `size` threads (the backend's
`max_concurrency`), started as work arrives, each sitting in the C extension's `native.ReadQueue.work()` with
the GIL released between jobs. A job is a group of pages to read and verify (never taking the GIL), a group
to stat, or a Python call (a write, a delete, a checked re-read, a client library's call), which its thread
runs with the GIL. A thread takes the next job the moment it finishes one: no event-loop round trip and no
GIL hand-off between two reads. Before, each group was its own thread call, and with the loop
busy (16 prefetches streaming) a thread waited up to the 5 ms GIL switch interval for each: on 2 cores the
threads sat idle most of a pass (0.7-1.3 of 4 busy, measured with per-thread spans). The jobs of one call
form a set that signals an eventfd the event loop watches once its last job finishes (a 64 MiB `get` split
over four threads wakes the loop once, not four times); one callback per wake-up collects every finished
job and wakes their callers.

A thread cannot be interrupted: a read stuck on a hung NFS or FUSE mount returns when the mount does. A
cancelled call therefore does not wait for its threads (its caller has a deadline). A job not started yet
is withdrawn and never starts; one already running is abandoned and registered in `stray_threads`, with the
buffers it may still read or write, until it returns, and a spare thread is started meanwhile so a stuck
job does not cost the others a thread. Callers keep those buffers out of use meanwhile (STYLE rule 8: never
free a buffer a thread may write into); every other buffer of the call is quiet once it returns, normally or
not. Spares are capped at `size` (`WorkerThreads.max_spares`): on a mount where every read hangs, each
abandoned read once added a thread without bound. At the cap no spare is started: new jobs queue behind the
stuck ones and their callers' deadlines fail them; each stuck job that returns retires the spare started for
it. This module imports nothing of hicache's, so every layer can use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Final, TypeVar, cast

from storage_backends import native

__all__ = ["GroupOutcome", "ReadHook", "ReadStatistics", "StrayThreads", "WorkerThreads", "stray_threads"]

T = TypeVar("T")

_NICE = 10
"""How much lower the worker threads' priority is than the process's (their nice value, raised per thread).
Hot reads are memory copies that keep every core busy; at equal priority the event loop's thread, waking
for its next callback, waited its turn behind them (the loop's wall stall grew while its own work per tick
did not). A worker at nice +10 gives its core to the loop thread as soon as that one wakes. Measured with
`bench_io`-style passes under a load average of ~7 (16 prefetches of 64 KiB pages, 3 passes x 3): the
longest stall's median fell from ~40 ms to ~25 ms; the workers still take every core the loop leaves."""

GroupOutcome = tuple[bytes, int, list[tuple[int, int]]]
"""What `native.read_pages` returns for a group: outcome bytes, the probe flags, (index, errno) of errors."""

ReadHook = Callable[[tuple[str, ...]], object]
"""Called in the worker thread with a group's keys before it is read (tests: a hung mount)."""


class StrayThreads:
    """Worker threads that cancelled storage calls left running, and the buffers each may still touch.

    `WorkerThreads` registers a job abandoned while running (`start`) and unregisters it once it returned
    (`finish`); callers ask `busy()` before reusing a buffer they passed to a cancelled call. Buffers are
    keyed by identity: the very objects passed to the call (a stray thread holds them, so no other object
    can take their id meanwhile). Updated from worker threads under a lock; read anywhere.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._busy: dict[int, int] = {}
        self._threads = 0

    @property
    def count(self) -> int:
        """Stray threads still running."""
        return self._threads

    def busy(self, buffers: Iterable[object]) -> bool:
        """Whether a stray thread may still touch any of `buffers`."""
        if not self._busy:
            return False
        busy = self._busy
        return any(id(buf) in busy for buf in buffers)

    def busy_flags(self, buffers: Iterable[object]) -> list[bool]:
        """One flag per buffer: may a stray thread still touch it."""
        busy = self._busy
        return [id(buf) in busy for buf in buffers]

    def start(self, buffers: Sequence[object]) -> None:
        """Register a stray thread that may still touch `buffers`; `finish` with the same buffers once it
        returned."""
        with self._lock:
            self._threads += 1
            for buf in buffers:
                self._busy[id(buf)] = self._busy.get(id(buf), 0) + 1

    def finish(self, buffers: Sequence[object]) -> None:
        """The stray thread registered by `start(buffers)` returned."""
        with self._lock:
            self._threads -= 1
            for buf in buffers:
                left = self._busy[id(buf)] - 1
                if left:
                    self._busy[id(buf)] = left
                else:
                    del self._busy[id(buf)]

    async def wait_quiet(self, buffers: Sequence[object], *, poll_s: float = 0.01) -> None:
        """Wait until no stray thread touches any of `buffers` (polled: threads cannot wake the loop
        safely once it may have stopped)."""
        while self.busy(buffers):  # noqa: ASYNC110 - a thread cannot set an asyncio.Event safely
            await asyncio.sleep(poll_s)

    def __repr__(self) -> str:
        return f"<StrayThreads running={self._threads} busy_buffers={len(self._busy)}>"


stray_threads: Final = StrayThreads()
"""The process-wide registry: worker threads are a process-wide resource, and so is the memory they touch."""


@dataclass(frozen=True, slots=True)
class ReadStatistics:
    """What a pool's threads read since they started (read and stat groups collected by the event loop;
    calls are not counted).

    Divide the growth of `reading_s` over a pass by the pass's wall time for the mean number of groups
    being read at once (at most the thread count): below it, the threads sat idle for want of queued work.

    Attributes:
        groups: groups read (stat-only groups included).
        reading_s: summed seconds from a worker taking a group to finishing it.
        queued_s: summed seconds groups waited in the queue for a worker.
    """

    groups: int = 0
    reading_s: float = 0.0
    queued_s: float = 0.0


class WorkerThreads:
    """At most `size` threads running one backend's blocking calls through one `native.ReadQueue`, plus up
    to `size` spares while jobs abandoned by their callers are still stuck (see the module).

    Threads start as jobs arrive, never more than `size` (spares aside), and stay until `close()`. Used
    from one event loop at a time (asyncio's: the loop watches the queue's eventfd). `close()` lets the
    workers leave once nothing is pending; a worker stuck in a job leaves when its job returns.

    Raises:
        ValueError: if `size` < 1.
    """

    def __init__(self, size: int, name: str) -> None:
        if size < 1:
            raise ValueError(f"size: expected >= 1, got {size}")
        self.size = size
        """The most threads running jobs at once, spares aside."""
        self._queue = native.ReadQueue()
        self._fd = self._queue.fileno()
        self._name = name
        self._waiting: dict[native.ReadJob, _Waiter] = {}
        self._abandoned: dict[native.ReadJob, tuple[Sequence[object], bool]] = {}
        """Jobs abandoned while running: their buffers, and whether a spare worker was started for them."""
        self._lock = threading.Lock()
        """Guards `_abandoned` and the stray registrations: a worker settles them once the loop is gone."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._groups = 0
        self._reading_ns = 0
        self._queued_ns = 0
        self.threads = 0
        """Worker threads started (stuck jobs' spares included)."""
        self._base = 0
        """Workers started that are no spares (at most `size`)."""
        self.max_spares = size
        """The most spare workers alive at once (one per job abandoned while running, see the module)."""
        self.spares = 0
        """Spare workers started for abandoned jobs still running (at most `max_spares`)."""
        self._workers: list[tuple[threading.Thread, threading.Event]] = []

    async def read(
        self,
        groups: Sequence[tuple[Sequence[str], Sequence[memoryview] | None]],
        *,
        root: str,
        suffix: str,
        namespace_digest: bytes,
        nowait: int,
        hook: ReadHook | None = None,
    ) -> list[GroupOutcome]:
        """Read every group (`native.read_pages`' arguments) in the workers; outcomes in group order.

        A group whose buffers are None is only stat-ed: HIT for each page that exists, up to the first
        absent (MISS) or failing (ERROR) one, MISS after it.

        Raises:
            RuntimeError: after `close()`.
            ValueError, TypeError: from `native.read_pages`' checks, before any group is queued.
        """
        submit = self._queue.submit
        jobs = await self._run(
            [
                partial(submit, root, suffix, keys, buffers, namespace_digest, nowait, hook)
                for keys, buffers in groups
            ],
            [buffers or () for _, buffers in groups],
        )
        return [job.result() for job in jobs]

    async def calls(self, funcs: Sequence[Callable[[], T]], touches: Sequence[Sequence[object]]) -> list[T]:
        """Call every `funcs[i]()` in the workers, which may read or write the buffers `touches[i]`;
        what they returned, in order, once every one returned (the first exception raised, if any).

        Raises:
            RuntimeError: after `close()`.
        """
        call = self._queue.call
        jobs = await self._run([partial(call, func) for func in funcs], touches)
        return [cast("T", job.result()) for job in jobs]

    async def call(self, func: Callable[..., T], *args: Any, touches: Sequence[object] = ()) -> T:
        """`func(*args)` in a worker, which may read or write the buffers `touches`.

        Raises:
            RuntimeError: after `close()`; else whatever `func` raised.
        """
        (result,) = await self.calls([partial(func, *args)], [touches])
        return result

    async def _run(
        self,
        submits: Sequence[Callable[[native.ReadJob | None], native.ReadJob]],
        touches: Sequence[Sequence[object]],
    ) -> list[native.ReadJob]:
        """Queue a job per `submits[i](leader)`, one set, and wait until all finished.

        When this returns, normally or not, no worker touches a buffer of a job it still runs unless that
        job is registered in `stray_threads` (cancelled while running)."""
        self._watch()
        jobs: list[native.ReadJob] = []
        waiter = _Waiter(len(submits))
        try:
            for submit in submits:
                job = submit(jobs[0] if jobs else None)  # one set: the loop is woken once, by its last job
                jobs.append(job)
                self._waiting[job] = waiter
            self._grow()
            await waiter.event.wait()
        except BaseException:
            for job, buffers in zip(jobs, touches, strict=False):
                self._withdraw(job, buffers)
            raise
        return jobs

    def close(self) -> None:
        """Refuse new jobs; workers leave once nothing is pending; stop watching from the loop (call it
        on the loop's thread). Idempotent."""
        self._queue.close()
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._fd)
        self._loop = None

    def close_queue(self) -> None:
        """`close()` without touching the event loop, from any thread (a backend collected unclosed)."""
        self._queue.close()

    def worker_ids(self) -> list[int]:
        """The native thread ids of the workers still running, once each has started (waits for that)."""
        for _, started in self._workers:
            started.wait(30)
        return [t.native_id for t, _ in self._workers if t.is_alive() and t.native_id is not None]

    @property
    def unclaimed(self) -> int:
        """The threads no job in flight claims (at least 1): the most groups a new batch is worth splitting
        into. When every thread has work (many prefetches at once) smaller groups buy no parallelism, only
        more thread hops for the loop to pay: sixteen concurrent prefetches splitting every 4 MiB batch into
        1 MiB jobs ran at ~2 GB/s where whole-batch jobs ran at ~3 GB/s (`bench/bench_io.py`)."""
        return max(1, self.size - len(self._waiting))

    @property
    def stray(self) -> int:
        """Jobs abandoned while running that have not returned yet."""
        return len(self._abandoned)

    def statistics(self) -> ReadStatistics:
        """Counters of the read and stat groups collected so far (see `ReadStatistics`)."""
        return ReadStatistics(self._groups, self._reading_ns / 1e9, self._queued_ns / 1e9)

    def _grow(self) -> None:
        """Start workers until there is one per job waiting or stuck, up to `size` (spares aside)."""
        while self._base < min(self.size, len(self._waiting) + len(self._abandoned)):
            self._base += 1
            self._start_worker()

    def _start_worker(self) -> None:
        self.threads += 1
        self._workers = [w for w in self._workers if w[0].is_alive()]
        started = threading.Event()
        worker = threading.Thread(
            target=self._work, args=(started,), name=f"{self._name}-{self.threads}", daemon=True
        )
        worker.start()
        self._workers.append((worker, started))

    def _work(self, started: threading.Event) -> None:
        # On Linux a thread is its own scheduling entity: this lowers the priority of this thread alone.
        with contextlib.suppress(OSError, AttributeError):
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + _NICE)
        started.set()
        self._queue.work()
        if self._queue.closed:  # the loop may be gone: settle what finished (abandoned jobs) here
            self._settle(self._queue.collect())

    def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        if loop is self._loop:
            return
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._fd)
        loop.add_reader(self._fd, self._on_ready)
        self._loop = loop

    def _on_ready(self) -> None:
        finished = self._queue.collect()
        for job in finished:  # counted here, on the loop's thread only
            if job.call:
                continue
            queued, started, done = job.times()
            self._groups += 1
            self._reading_ns += done - started
            self._queued_ns += started - queued
        self._settle(finished)

    def _settle(self, finished: list[native.ReadJob]) -> None:
        for job in finished:
            with self._lock:  # against `_withdraw`: a worker settles here once the queue is closed
                waiter = self._waiting.pop(job, None)
                abandoned = self._abandoned.pop(job, None) if waiter is None else None
                spared = False
                if abandoned is not None:
                    buffers, spared = abandoned
                    stray_threads.finish(buffers)
                    self.spares -= spared
            if waiter is not None:
                waiter.one_done()
            elif spared:
                self._queue.retire(1)  # the spare started for it is one worker too many now

    def _withdraw(self, job: native.ReadJob, buffers: Sequence[object]) -> None:
        """A cancelled caller's job: withdrawn if not started, dropped if finished (a job of a set waits
        uncollected for the set's last), else abandoned (see the module docstring).

        Under `_lock` with `_settle`: otherwise a worker leaving a closed queue could collect and settle the
        job between its `_waiting.pop` here and its registration in `_abandoned`, which would then never
        be finished (its buffers counted as a stray thread's for ever)."""
        with self._lock:
            if self._waiting.pop(job, None) is None or self._queue.cancel(job) or job.finished:
                return  # settled, withdrawn before it started, or finished: it touches no more
            spare = self.spares < self.max_spares and not self._queue.closed
            self.spares += spare
            self._abandoned[job] = (buffers, spare)
            stray_threads.start(buffers)
        if spare:
            self._start_worker()

    def __repr__(self) -> str:
        return (
            f"<WorkerThreads {self._name} size={self.size} threads={self.threads} "
            f"spares={self.spares}/{self.max_spares} waiting={len(self._waiting)} stray={self.stray}>"
        )


class _Waiter:
    """The jobs of one call still running; its event is set when the last finishes."""

    __slots__ = ("event", "left")

    def __init__(self, count: int) -> None:
        self.left = count
        self.event = asyncio.Event()
        if not count:
            self.event.set()

    def one_done(self) -> None:
        self.left -= 1
        if not self.left:
            self.event.set()
