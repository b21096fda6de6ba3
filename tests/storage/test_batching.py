"""gather_bounded and the per-page helpers: order, the concurrency bound, and failure handling."""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from functools import partial

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

from storage_backends.batching import (
    CORRUPT,
    ERROR,
    HIT,
    MISS,
    BackendStatistics,
    StatisticsRecorder,
    _cut_page_by_page,  # the general path, as the oracle
    check_batch,
    gather_bounded,
    gather_page_groups,
    group_slices,
)
from storage_backends.protocol import PageStatus
from storage_backends.threads import WorkerThreads


class Boom(Exception):
    """The failure the tests inject."""


async def test_results_come_back_in_call_order_whatever_the_finishing_order() -> None:
    """Calls finishing in reverse still land at their own index."""
    n = 6
    done = [anyio.Event() for _ in range(n + 1)]
    done[n].set()

    async def step(i: int) -> int:
        await done[i + 1].wait()  # call i finishes only after call i+1
        done[i].set()
        return i * 10

    assert await gather_bounded([partial(step, i) for i in range(n)], limit=n) == [i * 10 for i in range(n)]


@pytest.mark.parametrize(("n", "limit"), [(10, 3), (4, 8), (5, 1)])
async def test_no_more_than_limit_run_at_once(n: int, limit: int) -> None:
    """The bound is reached and never exceeded."""
    active = peak = 0
    gate = anyio.Event()

    async def call(i: int) -> int:
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        await gate.wait()
        active -= 1
        return i

    async def open_gate_when_all_blocked() -> None:
        await anyio.wait_all_tasks_blocked()
        assert active == min(n, limit)
        gate.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(open_gate_when_all_blocked)
        results = await gather_bounded([partial(call, i) for i in range(n)], limit)
    assert results == list(range(n))
    assert peak == min(n, limit)


async def test_first_failure_cancels_and_awaits_siblings() -> None:
    """The failure is re-raised as itself, after every running sibling was cancelled and finished."""
    never = anyio.Event()
    started: list[int] = []
    finished: list[int] = []

    async def blocked(i: int) -> int:
        started.append(i)
        try:
            await never.wait()
        finally:
            finished.append(i)
        return i

    async def failing() -> int:
        await anyio.wait_all_tasks_blocked()
        raise Boom("page 2 failed")

    funcs: list[Callable[[], Awaitable[int]]] = [
        partial(blocked, 0),
        partial(blocked, 1),
        failing,
        *(partial(blocked, i) for i in range(3, 10)),
    ]
    with pytest.raises(Boom, match="page 2 failed"):
        await gather_bounded(funcs, limit=3)
    assert sorted(started) == [0, 1], "calls after the failure never start"
    assert sorted(finished) == [0, 1], "running siblings were cancelled and awaited"


async def test_outer_cancellation_propagates_and_cancels_every_call() -> None:
    """Cancelling the caller cancels the calls; nothing is left running."""
    never = anyio.Event()
    finished: list[int] = []

    async def blocked(i: int) -> int:
        try:
            await never.wait()
        finally:
            finished.append(i)
        return i

    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(gather_bounded, [partial(blocked, i) for i in range(5)], 2)
            await anyio.wait_all_tasks_blocked()
            scope.cancel()
    assert scope.cancelled_caught
    assert sorted(finished) == [0, 1]


async def test_empty_and_single_batches() -> None:
    """No calls gives []; one call is awaited directly."""

    async def one() -> str:
        return "x"

    assert await gather_bounded([], limit=4) == []
    assert await gather_bounded([one], limit=4) == ["x"]


async def test_limit_below_one_is_rejected() -> None:
    """limit must be >= 1."""
    with pytest.raises(ValueError, match="limit"):
        await gather_bounded([], limit=0)


def test_group_slices_spreads_small_pages_and_keeps_big_ones_alone() -> None:
    """Groups respect the byte target, cover the batch in order, and give every thread work."""
    assert group_slices([], limit=4, group_bytes=100) == []
    small = group_slices([10] * 100, limit=4, group_bytes=100)
    assert all(s.stop - s.start <= 10 for s in small)
    assert [i for s in small for i in range(s.start, s.stop)] == list(range(100))
    big = group_slices([1000] * 5, limit=4, group_bytes=100)
    assert [(s.start, s.stop) for s in big] == [(i, i + 1) for i in range(5)]
    few = group_slices([1] * 8, limit=4, group_bytes=1 << 20)
    assert [s.stop - s.start for s in few] == [2, 2, 2, 2]


@given(
    pages=st.integers(1, 300),
    size=st.integers(1, 1 << 21),
    limit=st.integers(1, 20),
    group_bytes=st.integers(1, 1 << 23),
    min_group_bytes=st.integers(0, 1 << 22),
)
def test_group_slices_of_one_page_size_cut_where_the_page_by_page_rule_cuts(
    pages: int, size: int, limit: int, group_bytes: int, min_group_bytes: int
) -> None:
    """Pages of one size take an arithmetic path (no loop over pages on the event loop): it must cut
    exactly where the page-by-page rule cuts."""
    sizes = [size] * pages
    fast = group_slices(sizes, limit=limit, group_bytes=group_bytes, min_group_bytes=min_group_bytes)
    per_thread = -(-pages // limit)
    assert fast == _cut_page_by_page(sizes, per_thread, group_bytes, min_group_bytes)


def test_group_slices_keeps_small_batches_together_under_min_group_bytes() -> None:
    """Spreading over threads stops where a group would carry less than `min_group_bytes`."""
    assert group_slices([64] * 8, limit=16, group_bytes=1 << 20, min_group_bytes=1024) == [slice(0, 8)]
    spread = group_slices([512] * 8, limit=16, group_bytes=1 << 20, min_group_bytes=1024)
    assert [(s.start, s.stop) for s in spread] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    # a large batch still honours the byte target and gives every thread work
    many = group_slices([64] * 1000, limit=4, group_bytes=6400, min_group_bytes=1024)
    assert all(s.stop - s.start <= 100 for s in many)
    assert len(many) >= 4
    assert [i for s in many for i in range(s.start, s.stop)] == list(range(1000))


def test_check_batch_names_the_bad_argument() -> None:
    """Length mismatches and non-contiguous buffers raise ValueError naming buffers."""
    page = memoryview(bytearray(8))
    check_batch(["abcd"], [page])
    with pytest.raises(ValueError, match="buffers"):
        check_batch(["abcd", "abce"], [page])
    with pytest.raises(ValueError, match=r"buffers\[0\]"):
        check_batch(["abcd"], [page[::2]])
    with pytest.raises(ValueError, match=r"buffers\[0\]"):
        check_batch(["abcd"], [bytearray(8)])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="keys"):
        check_batch("abcd", [page])


def test_statistics_recorder_tallies_outcomes() -> None:
    """Per-page outcomes become flags and frozen counters."""
    rec = StatisticsRecorder()
    bufs = [memoryview(bytearray(n)) for n in (10, 20, 30, 40)]
    assert rec.record_reads([HIT, MISS, CORRUPT, ERROR], bufs) == [HIT, MISS, CORRUPT, ERROR]
    assert rec.record_writes([HIT, ERROR], bufs[:2]) == [True, False]
    assert rec.snapshot() == BackendStatistics(
        pages_read=1,
        pages_written=1,
        bytes_read=10,
        bytes_written=10,
        misses=1,
        checksum_failures=1,
        errors=2,
    )


async def test_a_batch_is_spread_only_over_threads_no_other_call_has_claimed() -> None:
    """Under load (every thread claimed by jobs in flight) a batch goes to one thread call, not four.

    Guards the controller's prefetch path: sixteen concurrent prefetches splitting every 4 MiB batch into
    1 MiB thread calls ran at ~2 GB/s where whole-batch calls ran at ~3 GB/s (`bench/bench_io.py`).
    """
    workers = WorkerThreads(4, name="test-batching")
    calls: list[int] = []
    release = threading.Event()

    def read(keys: list[str], buffers: list[memoryview]) -> list[PageStatus]:
        calls.append(len(keys))
        return [HIT] * len(keys)

    def busy() -> None:
        assert release.wait(30), "test gate never opened"

    keys = [f"{i:04x}" for i in range(16)]
    views = [memoryview(bytearray(1 << 16)) for _ in keys]
    common = {"workers": workers, "group_bytes": 4 << 20, "min_group_bytes": 1 << 18}
    try:
        assert await gather_page_groups(read, keys, views, **common) == [HIT] * 16  # type: ignore[arg-type]
        assert calls == [4, 4, 4, 4]  # idle threads: spread over all four
        assert workers.unclaimed == 4

        calls.clear()
        async with anyio.create_task_group() as tg:
            tg.start_soon(workers.calls, [busy] * 4, [()] * 4)  # another call's jobs, in flight
            await anyio.wait_all_tasks_blocked()
            assert workers.unclaimed == 1
            tg.start_soon(partial(gather_page_groups, read, keys, views, **common))  # type: ignore[arg-type]
            await anyio.wait_all_tasks_blocked()
            release.set()
        assert calls == [16]
        assert workers.unclaimed == 4
    finally:
        release.set()
        workers.close()
