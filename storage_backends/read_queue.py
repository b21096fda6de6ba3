"""The file backend's read threads: the C extension's `ReadQueue` with its workers, waited on from the loop.

Worker threads sit in `ReadQueue.work()` with the GIL released for their whole life and take the next page
group as soon as they finish one. Before, each group was its own `anyio.to_thread` call: a thread needed the
GIL back after every group and the event loop to hand it the next one, and with the loop busy (16 prefetches
streaming) it waited up to the 5 ms GIL switch interval each time; on 2 cores the threads then sat idle most
of a pass (measured with per-thread spans: 0.7-1.3 of 4 threads busy, 1.5-5 ms between two groups of one
thread). The groups of one `run` call form a set that signals an eventfd the event loop watches once its
last group finishes (a 64 MiB `get` split over four threads used to wake the loop four times); one callback
per wake-up collects every finished group and wakes their callers.

A cancelled caller keeps the rules of `storage_backends.threads`: a group not started yet is withdrawn and
never starts; a group already reading is abandoned and its buffers are registered in `stray_threads` until
it finishes, and a spare worker is added meanwhile so a read stuck on a hung mount does not cost the others
a thread. Spares are capped at the base thread count (`ReadThreads.max_spares`): on a mount where every read
hangs, each abandoned read, `exists` stat and breaker probe added one more thread, without bound. At the cap
no spare is added: the groups queue behind the stuck reads and their callers' deadlines fail them (counted as
timeouts, which open the breaker); each stuck read that returns retires the spare started for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import anyio

from storage_backends import native
from storage_backends.threads import stray_threads

__all__ = ["GroupOutcome", "ReadHook", "ReadStatistics", "ReadThreads"]

_READER_NICE = 10
"""How much lower the read threads' priority is than the process's (their nice value, raised per thread).
Hot reads are memory copies that keep every core busy; at equal priority the event loop's thread, waking
for its next callback, waited its turn behind them (the loop's wall stall grew while its own work per tick
did not). A reader at nice +10 gives its core to the loop thread as soon as that one wakes. Measured with
`bench_io`-style passes under a load average of ~7 (16 prefetches of 64 KiB pages, 3 passes x 3): the
longest stall's median fell from ~40 ms to ~25 ms; the readers still take every core the loop leaves."""

GroupOutcome = tuple[bytes, int, list[tuple[int, int]]]
"""What `native.read_pages` returns for a group: outcome bytes, the probe flags, (index, errno) of errors."""

ReadHook = Callable[[tuple[str, ...]], object]
"""Called in the worker thread with a group's keys before it is read (tests: a hung mount)."""


@dataclass(frozen=True, slots=True)
class ReadStatistics:
    """What the read threads did since they started (groups collected by the event loop).

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


class ReadThreads:
    """`threads` workers reading page groups through one `native.ReadQueue`, and the callers waiting; plus up
    to `threads` spares while groups abandoned by their callers are still stuck reading (see the module).

    Used from one event loop at a time (asyncio's: the loop watches the queue's eventfd). `close()` lets the
    workers leave once nothing is pending; a worker stuck in a read leaves when its read returns.
    """

    def __init__(self, threads: int, name: str) -> None:
        if threads < 1:
            raise ValueError(f"threads: expected >= 1, got {threads}")
        self._queue = native.ReadQueue()
        self._fd = self._queue.fileno()
        self._name = name
        self._waiting: dict[native.ReadJob, _Waiter] = {}
        self._abandoned: dict[native.ReadJob, tuple[Sequence[object], bool]] = {}
        """Groups abandoned while reading: their buffers, and whether a spare worker was started for them."""
        self._lock = threading.Lock()
        """Guards `_abandoned` and the stray registrations: a worker settles them once the loop is gone."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._groups = 0
        self._reading_ns = 0
        self._queued_ns = 0
        self.threads = 0
        """Worker threads started (stuck reads' spares included)."""
        self.max_spares = threads
        """The most spare workers alive at once (one per group abandoned while reading, see the module)."""
        self.spares = 0
        """Spare workers started for abandoned groups still reading (at most `max_spares`)."""
        self._workers: list[tuple[threading.Thread, threading.Event]] = []
        for _ in range(threads):
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
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + _READER_NICE)
        started.set()
        self._queue.work()
        if self._queue.closed:  # the loop may be gone: settle what finished (abandoned groups) here
            self._settle(self._queue.collect())

    async def run(
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

        When this returns, normally or not, no worker writes into a buffer of a group it still reads
        unless that group is registered in `stray_threads` (cancelled while reading).

        Raises:
            RuntimeError: after `close()`.
            ValueError, TypeError: from `native.read_pages`' checks, before any group is queued.
        """
        self._watch()
        jobs: list[native.ReadJob] = []
        waiter = _Waiter(len(groups))
        try:
            for keys, buffers in groups:
                # One set per call: the loop is woken once, when the call's last group finishes.
                leader = jobs[0] if jobs else None
                job = self._queue.submit(root, suffix, keys, buffers, namespace_digest, nowait, hook, leader)
                jobs.append(job)
                self._waiting[job] = waiter
            await waiter.event.wait()
        except BaseException:
            for job, (_, buffers) in zip(jobs, groups, strict=False):
                self._withdraw(job, buffers or ())
            raise
        return [job.result() for job in jobs]

    def close(self) -> None:
        """Refuse new groups; workers leave once nothing is pending; stop watching from the loop (call it
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
    def stray(self) -> int:
        """Groups abandoned while reading that have not finished yet."""
        return len(self._abandoned)

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
            queued, started, done = job.times()
            self._groups += 1
            self._reading_ns += done - started
            self._queued_ns += started - queued
        self._settle(finished)

    def statistics(self) -> ReadStatistics:
        """Counters of the groups collected so far (see `ReadStatistics`)."""
        return ReadStatistics(self._groups, self._reading_ns / 1e9, self._queued_ns / 1e9)

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
        """A cancelled caller's job: withdrawn if not started, dropped if finished (a group of a set waits
        uncollected for the set's last), else abandoned (see the module docstring).

        Under `_lock` with `_settle`: otherwise a worker leaving a closed queue could collect and settle the
        job between its `_waiting.pop` here and its registration in `_abandoned`, which would then never
        be finished (its buffers counted as a stray thread's for ever)."""
        with self._lock:
            if self._waiting.pop(job, None) is None or self._queue.cancel(job) or job.finished:
                return  # settled, withdrawn before it started, or finished: it writes no more
            spare = self.spares < self.max_spares and not self._queue.closed
            self.spares += spare
            self._abandoned[job] = (buffers, spare)
            stray_threads.start(buffers)
        if spare:
            self._start_worker()

    def __repr__(self) -> str:
        return (
            f"<ReadThreads {self._name} threads={self.threads} spares={self.spares}/{self.max_spares} "
            f"waiting={len(self._waiting)} stray={self.stray}>"
        )


class _Waiter:
    """The groups of one `run` call still reading; its event is set when the last finishes."""

    __slots__ = ("event", "left")

    def __init__(self, count: int) -> None:
        self.left = count
        self.event = anyio.Event()
        if not count:
            self.event.set()

    def one_done(self) -> None:
        self.left -= 1
        if not self.left:
            self.event.set()
