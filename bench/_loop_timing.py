"""Timing a pass inside the event loop next to a ticker that measures the loop's longest stall.

Shared by the benchmarks (a leading underscore keeps `hicache bench` from running it as one).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio

T = TypeVar("T")


async def run_with_ticker(run: Callable[[], Awaitable[T]]) -> tuple[T, float, float]:
    """Await `run()` while a ticker task records its own lateness; return (result, seconds, stall ms).

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

    async def ticker() -> None:
        nonlocal worst
        while not done.is_set():
            t = time.perf_counter()
            await anyio.sleep(0.001)
            worst = max(worst, time.perf_counter() - t - 0.001)

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
    return result, seconds, worst * 1000
