"""One cancellation vocabulary: asyncio's, with `storage_backends.cancellation` for what asyncio lacks.

The library imports no anyio (its shields do not stop asyncio's own cancellation, which is what callers
use), and the helpers keep the promises the shields and `anyio.to_thread.run_sync` used to make.
"""

from __future__ import annotations

import ast
import asyncio
import threading
from pathlib import Path

import pytest

from storage_backends.cancellation import StopScope, carried_out, run_in_thread, uncancellable

ROOT = Path(__file__).resolve().parents[1]


def test_the_library_imports_no_anyio() -> None:
    """A module of `hicache/` or `storage_backends/` that imports anyio brings a second vocabulary back."""
    found = []
    for package in ("hicache", "storage_backends"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = (
                    [alias.name for alias in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                    if isinstance(node, ast.ImportFrom)
                    else []
                )
                if any(name == "anyio" or name.startswith("anyio.") for name in names):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, f"these modules import anyio: {found}"


@pytest.mark.parametrize("how", ["asyncio.timeout", "task.cancel"])
async def test_uncancellable_work_ends_before_the_cancellation_propagates(how: str) -> None:
    """A cancelled caller waits for the work, which is not cancelled, then gets its cancellation."""
    arrived, gate = asyncio.Event(), asyncio.Event()
    ended = []

    async def work() -> int:
        arrived.set()
        await gate.wait()
        ended.append(True)
        return 7

    deadline = asyncio.timeout(None)

    async def caller() -> int:
        async with deadline:
            return await uncancellable(work())

    loop = asyncio.get_running_loop()
    task = loop.create_task(caller())
    await arrived.wait()
    if how == "asyncio.timeout":
        deadline.reschedule(loop.time())
    else:
        task.cancel()
    for _ in range(5):
        await asyncio.sleep(0)
    assert not task.done(), "the cancelled caller returned while its work was still running"
    task.cancel()  # a second cancellation is absorbed too
    for _ in range(5):
        await asyncio.sleep(0)
    assert not task.done()
    gate.set()
    (done,) = await asyncio.gather(task, return_exceptions=True)
    assert ended == [True]
    assert isinstance(done, asyncio.CancelledError)  # two cancellations: not the timeout's alone


async def test_uncancellable_passes_the_result_and_the_error_through() -> None:
    """Uncancelled, it is the work's own result or exception."""

    async def fails() -> None:
        raise ValueError("boom")

    async def returns() -> str:
        return "ok"

    assert await uncancellable(returns()) == "ok"
    with pytest.raises(ValueError, match="boom"):
        await uncancellable(fails())


async def test_run_in_thread_waits_for_its_thread_under_cancellation() -> None:
    """A cancelled thread call returns only once its thread returned (the buffer it writes is then quiet)."""
    started, release = threading.Event(), threading.Event()
    buffer = bytearray(4)

    def write() -> None:
        started.set()
        release.wait(timeout=30)
        buffer[:] = b"done"

    loop = asyncio.get_running_loop()
    task = loop.create_task(run_in_thread(write))
    await asyncio.to_thread(started.wait)
    task.cancel()
    for _ in range(5):
        await asyncio.sleep(0)
    assert not task.done(), "the cancelled call returned while its thread was still writing"
    release.set()
    (done,) = await asyncio.gather(task, return_exceptions=True)
    assert isinstance(done, asyncio.CancelledError)
    assert buffer == b"done"


async def test_run_in_thread_bounds_its_calls_with_the_limiter() -> None:
    """A call waiting for the limiter is cancellable and never starts."""
    limiter = asyncio.Semaphore(1)
    started, release = threading.Event(), threading.Event()
    ran = []
    first = asyncio.get_running_loop().create_task(run_in_thread(lambda: (started.set(), release.wait(30))))
    await asyncio.to_thread(started.wait)
    await limiter.acquire()  # held as the first call's slot would be
    second = asyncio.get_running_loop().create_task(run_in_thread(ran.append, 1, limiter=limiter))
    await asyncio.sleep(0)
    second.cancel()
    (done,) = await asyncio.gather(second, return_exceptions=True)
    assert isinstance(done, asyncio.CancelledError)
    assert ran == []
    limiter.release()
    release.set()
    await first
    assert await run_in_thread(sum, (1, 2), limiter=limiter) == 3


async def test_stop_scope_is_stopped_by_another_task_and_exits_quietly() -> None:
    """`stop()` cuts the body short at its await; the scope swallows its own cancellation only."""
    arrived = asyncio.Event()
    scope = StopScope()

    async def body() -> str:
        async with scope:
            arrived.set()
            await asyncio.Event().wait()
        return "after"

    task = asyncio.get_running_loop().create_task(body())
    await arrived.wait()
    scope.stop()
    scope.stop()  # idempotent
    await asyncio.sleep(0)
    scope.stop()  # and once the cancellation is on its way
    assert await task == "after"
    assert scope.stopped
    assert scope.cut_short


async def test_stop_scope_deadline_and_stop_before_entry() -> None:
    """A deadline cuts the body short like `stop()`; a scope stopped before entry cuts it at once; a body
    that ends in time is not cut short; a `TimeoutError` of the body's own propagates."""
    async with StopScope(0) as expired:
        await asyncio.sleep(1)
    assert expired.cut_short
    assert not expired.stopped
    early = StopScope()
    early.stop()
    async with early:
        await asyncio.sleep(1)
    assert early.cut_short
    async with StopScope(60) as in_time:
        await asyncio.sleep(0)
    assert not in_time.cut_short
    with pytest.raises(TimeoutError, match="own"):
        async with StopScope(60):
            raise TimeoutError("own")
    with pytest.raises(TypeError, match="delay"):
        StopScope("1")  # type: ignore[arg-type]


async def test_carried_out_hands_the_cancellation_back_with_the_result() -> None:
    """`carried_out` is `uncancellable` for a caller with more to do: the work ends whole, and its result
    comes back with the caller's cancellation instead of the cancellation alone; a work that raised while
    the caller was cancelled gives the cancellation."""
    released = asyncio.Event()

    async def work() -> int:
        await released.wait()
        return 7

    async def caller() -> tuple[int, bool]:
        result, cancelled = await carried_out(work())
        return result, cancelled is not None

    task = asyncio.get_running_loop().create_task(caller())
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.sleep(0)
    assert not task.done()
    released.set()
    assert await task == (7, True)
    assert await carried_out(asyncio.sleep(0, result=3)) == (3, None)

    async def fails() -> None:
        await asyncio.sleep(0.01)
        raise OSError("work: failed")

    failing = asyncio.get_running_loop().create_task(carried_out(fails()))
    await asyncio.sleep(0)
    failing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await failing
