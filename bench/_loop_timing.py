"""Timing a pass inside the event loop next to a ticker that measures the loop's longest stall.

Shared by the benchmarks (a leading underscore keeps `hicache bench` from running it as one).

Set `HICACHE_TRACE_STALLS_MS` (e.g. `=2`) to see what the stalls are made of: every timed pass then
prints to stderr its slowest loop iterations over that much loop-thread CPU, each with the callbacks that
ran in it (a task's callback named by where its coroutine chain is suspended after the step). This wraps
asyncio's private `_run_once` and `Handle._run` for the pass, so it costs a little per callback: trace to
explain a stall, measure without it.
"""

from __future__ import annotations

import asyncio
import asyncio.events
import contextlib
import gc
import os
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import anyio

T = TypeVar("T")


@dataclass(frozen=True)
class Ticked(Generic[T]):
    """One pass timed next to the ticker.

    Attributes:
        result: what `run()` returned.
        seconds: wall time of the pass.
        stall_ms: the loop's longest lateness (wall): its own work, plus waits for the GIL and for a core.
        stall_cpu_ms: the most CPU time the loop thread spent between two ticks: the loop's own work
            only, which the machine's load does not inflate (a shared machine's load does the wall figure).
        stall_runqueue_ms: of the longest wall stall, the time the loop thread was runnable but waited
            for a core (the kernel's run-queue wait, `/proc/thread-self/schedstat`; 0 where that is not
            readable). What is left of the stall beyond its CPU and this is time the thread slept: waiting
            for the GIL, which another thread held.
        stall_at_cpu_ms: the loop thread's own CPU within that longest wall stall (`stall_cpu_ms` is the
            longest CPU stretch, often another tick).
    """

    result: T
    seconds: float
    stall_ms: float
    stall_cpu_ms: float
    stall_runqueue_ms: float = 0.0
    stall_at_cpu_ms: float = 0.0


@dataclass
class _Iteration:
    cpu_s: float
    wall_s: float
    callbacks: list[tuple[float, str]] = field(default_factory=list)


def _describe(handle: asyncio.Handle) -> str:
    """A callback, or the task it steps, as the frames its coroutine chain is suspended in."""
    callback: Any = handle._callback  # type: ignore[attr-defined]
    task = getattr(callback, "__self__", None)
    if not isinstance(task, asyncio.Task):
        return repr(callback)[:120]
    frames: list[str] = []
    coro: Any = task.get_coro()
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            frames.append(f"{frame.f_code.co_name}:{frame.f_lineno}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return "task " + (" > ".join(frames[-6:]) or "(finished)")


@contextlib.contextmanager
def _trace_stalls(threshold_ms: float, label: str, top: int = 5) -> Iterator[None]:
    """Record the loop iterations over `threshold_ms` of loop-thread CPU; print the `top` ones at exit."""
    loop: Any = asyncio.get_running_loop()
    slow: list[_Iteration] = []
    current: list[tuple[float, str]] = []
    handle_run: Any = asyncio.events.Handle._run  # type: ignore[attr-defined]
    run_once = loop._run_once

    def timed_handle(handle: asyncio.Handle) -> None:
        start = time.thread_time()
        handle_run(handle)
        spent = time.thread_time() - start
        if spent > threshold_ms / 10_000:  # a tenth of the threshold: the parts worth naming
            current.append((spent, _describe(handle)))

    def timed_iteration() -> None:
        current.clear()
        cpu, wall = time.thread_time(), time.perf_counter()
        run_once()
        spent = time.thread_time() - cpu
        if spent * 1000 > threshold_ms:
            slow.append(_Iteration(spent, time.perf_counter() - wall, list(current)))

    asyncio.events.Handle._run = timed_handle  # type: ignore[method-assign]
    loop._run_once = timed_iteration
    try:
        yield
    finally:
        asyncio.events.Handle._run = handle_run  # type: ignore[method-assign]
        del loop._run_once
        for it in sorted(slow, key=lambda i: -i.cpu_s)[:top]:
            print(
                f"[stall trace {label}] iteration: {it.cpu_s * 1000:.2f} ms loop CPU, "
                f"{it.wall_s * 1000:.2f} ms wall, {len(it.callbacks)} callbacks named",
                file=sys.stderr,
            )
            merged: dict[str, list[float]] = {}
            for spent, name in it.callbacks:
                merged.setdefault(name, []).append(spent)
            for name, spents in sorted(merged.items(), key=lambda kv: -sum(kv[1]))[:8]:
                print(f"    {len(spents):3d}x {sum(spents) * 1000:7.2f} ms  {name}", file=sys.stderr)


async def time_with_ticker(run: Callable[[], Awaitable[T]]) -> Ticked[T]:
    """Await `run()` while a ticker task records its own lateness, in wall and in loop-thread CPU time.

    Collects garbage first: a closed cache caught in a reference cycle can still hold a large pool, and
    freeing it inside a timed pass stalled the loop for ~100 ms. Then freezes the survivors out of the
    collector's reach for the pass (`gc.freeze()`), as serving engines do once their model is loaded
    (SGLang has `freeze_gc`, vLLM `freeze_gc_heap`): otherwise a full collection, which walks every
    object of the process (~170k after importing torch: 100-170 ms here), can land inside a pass and is
    then the loop's longest stall, whatever the code under test does.
    """
    gc.collect()
    gc.freeze()
    done = anyio.Event()
    worst = worst_cpu = worst_queued = worst_at_cpu = 0.0
    waited, close_clock = _runqueue_clock()

    async def ticker() -> None:
        nonlocal worst, worst_cpu, worst_queued, worst_at_cpu
        while not done.is_set():
            t = time.perf_counter()
            c = time.thread_time()  # the loop thread's CPU: every callback that runs until the next tick
            q = waited()
            await anyio.sleep(0.001)
            late = time.perf_counter() - t - 0.001
            cpu = time.thread_time() - c
            if late > worst:
                worst, worst_queued, worst_at_cpu = late, waited() - q, cpu
            worst_cpu = max(worst_cpu, cpu)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            await anyio.sleep(0.005)  # let the ticker settle
            trace_ms = os.environ.get("HICACHE_TRACE_STALLS_MS")
            tracing = (
                _trace_stalls(float(trace_ms), getattr(run, "__qualname__", "pass"))
                if trace_ms
                else contextlib.nullcontext()
            )
            with tracing:
                start = time.perf_counter()
                result = await run()
                seconds = time.perf_counter() - start
            done.set()
    finally:
        close_clock()
        gc.unfreeze()  # the next pass's collection must reach what this one left behind
    return Ticked(result, seconds, worst * 1000, worst_cpu * 1000, worst_queued * 1000, worst_at_cpu * 1000)


def _runqueue_clock() -> tuple[Callable[[], float], Callable[[], None]]:
    """A clock of the calling thread's run-queue wait in seconds (Linux `schedstat`: the time it was
    runnable but not running; ~2.5 us a reading), and its closer. The clock stays at 0 where the file
    cannot be read."""
    try:
        fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
    except OSError:
        return (lambda: 0.0), (lambda: None)

    def waited() -> float:
        return int(os.pread(fd, 64, 0).split()[1]) / 1e9

    return waited, lambda: os.close(fd)


async def run_with_ticker(run: Callable[[], Awaitable[T]]) -> tuple[T, float, float]:
    """`time_with_ticker`, as (result, seconds, wall stall ms)."""
    ticked = await time_with_ticker(run)
    return ticked.result, ticked.seconds, ticked.stall_ms
