"""Timing a pass inside the event loop next to a ticker that measures the loop's longest stall.

Shared by the benchmarks (a leading underscore keeps `hicache bench` from running it as one).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

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
    """

    result: T
    seconds: float
    stall_ms: float
    stall_cpu_ms: float


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
    worst = 0.0
    worst_cpu = 0.0

    async def ticker() -> None:
        nonlocal worst, worst_cpu
        while not done.is_set():
            t = time.perf_counter()
            c = time.thread_time()  # the loop thread's CPU: every callback that runs until the next tick
            await anyio.sleep(0.001)
            worst = max(worst, time.perf_counter() - t - 0.001)
            worst_cpu = max(worst_cpu, time.thread_time() - c)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            await anyio.sleep(0.005)  # let the ticker settle
            start = time.perf_counter()
            result = await run()
            seconds = time.perf_counter() - start
            done.set()
    finally:
        gc.unfreeze()  # the next pass's collection must reach what this one left behind
    return Ticked(result, seconds, worst * 1000, worst_cpu * 1000)


async def run_with_ticker(run: Callable[[], Awaitable[T]]) -> tuple[T, float, float]:
    """`time_with_ticker`, as (result, seconds, wall stall ms)."""
    ticked = await time_with_ticker(run)
    return ticked.result, ticked.seconds, ticked.stall_ms
