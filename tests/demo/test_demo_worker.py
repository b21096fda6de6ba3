"""The demo's model thread takes at most `max_calls` calls at once: a submitter past that waits on the loop
(backpressure), a decode between its steps keeps its slot without waiting for one (no self-deadlock), a
submitter cancelled while it waits leaves nothing queued, and `close` lets every admitted call end and
refuses the submitters still waiting."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Generator

import anyio
import anyio.lowlevel
import anyio.to_thread
import pytest

from hicache.demo.worker import ModelWorker, _Job


class Gate:
    """A model call that waits in the model thread until `open()`, recording that it ran."""

    def __init__(self, ran: list[str], name: str) -> None:
        self.ran = ran
        self.name = name
        self.entered = threading.Event()
        self._go = threading.Event()

    def __call__(self) -> str:
        self.entered.set()
        assert self._go.wait(30), "the test never opened the gate"
        self.ran.append(self.name)
        return self.name

    def open(self) -> None:
        self._go.set()


def recorder(ran: list[str], name: str) -> Callable[[], str]:
    def call() -> str:
        ran.append(name)
        return name

    return call


async def test_submitters_past_the_bound_wait_and_run_in_order() -> None:
    """Guards against an unbounded queue: with the model held, every submitter queued its call at once
    (the queue grew with the load); now at most `max_calls` are in the worker and the rest wait on the
    loop, then run in submission order."""
    worker = ModelWorker(None, max_calls=2)
    ran: list[str] = []
    held = Gate(ran, "a")
    results: list[str] = []

    async def submit(fn: Callable[[], str]) -> None:
        results.append(await worker.call(fn))

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(submit, held)
            await anyio.to_thread.run_sync(held.entered.wait)
            for name in "bcde":
                tg.start_soon(submit, recorder(ran, name))
            await anyio.wait_all_tasks_blocked()
            assert (worker.admitted, worker.waiting) == (2, 1)  # a runs, b queued, c d e wait on the loop
            assert ran == []
            held.open()
    finally:
        held.open()
        worker.close()
    assert ran == list("abcde")
    assert sorted(results) == list("abcde")
    assert worker.admitted == 0


async def test_a_decode_keeps_its_slot_between_steps() -> None:
    """A decode puts itself back into the queue after each step without waiting for room (it holds its
    slot), so a full worker never deadlocks on its own decodes; a call submitted meanwhile waits for the
    decode to end."""
    worker = ModelWorker(None, max_calls=1)
    ran: list[str] = []
    first = Gate(ran, "step 0")

    def decode() -> Generator[None, None, str]:
        first()
        yield
        ran.append("step 1")
        yield
        ran.append("step 2")
        return "decoded"

    try:
        async with anyio.create_task_group() as tg:
            outcomes: list[str] = []

            async def run_decode() -> None:
                outcomes.append(await worker.steps(decode()))

            async def run_call() -> None:
                outcomes.append(await worker.call(recorder(ran, "call")))

            tg.start_soon(run_decode)
            await anyio.to_thread.run_sync(first.entered.wait)
            tg.start_soon(run_call)
            await anyio.wait_all_tasks_blocked()
            assert (worker.admitted, worker.waiting) == (1, 0)
            first.open()
    finally:
        first.open()
        worker.close()
    assert ran == ["step 0", "step 1", "step 2", "call"]
    assert outcomes == ["decoded", "call"]


async def test_a_submitter_cancelled_while_waiting_for_room_queues_nothing() -> None:
    """A submitter cancelled while it waits for room leaves at once: its call never runs and it holds no
    slot (the next call is admitted when the running one ends)."""
    worker = ModelWorker(None, max_calls=1)
    ran: list[str] = []
    held = Gate(ran, "a")
    scope = anyio.CancelScope()

    async def cancelled_submitter() -> None:
        with scope:
            await worker.call(recorder(ran, "cancelled"))

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(worker.call, held)
            await anyio.to_thread.run_sync(held.entered.wait)
            tg.start_soon(cancelled_submitter)
            await anyio.wait_all_tasks_blocked()
            scope.cancel()
            await anyio.wait_all_tasks_blocked()
            assert scope.cancelled_caught
            assert (worker.admitted, worker.waiting) == (1, 0)
            held.open()
        assert await worker.call(recorder(ran, "next")) == "next"
    finally:
        held.open()
        worker.close()
    assert ran == ["a", "next"]
    assert worker.admitted == 0


async def test_close_lets_admitted_calls_end_and_refuses_the_waiting_ones() -> None:
    """`close` (from a thread, as the demo calls it) while the worker is full and a submitter waits for
    room: the admitted call returns to its caller, the waiting submitter is refused, nothing deadlocks;
    later submissions are refused at once."""
    worker = ModelWorker(None, max_calls=1)
    ran: list[str] = []
    held = Gate(ran, "a")
    outcomes: list[str] = []

    async def submit(fn: Callable[[], str]) -> None:
        try:
            outcomes.append(await worker.call(fn))
        except RuntimeError as exc:
            outcomes.append(str(exc))

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(submit, held)
            await anyio.to_thread.run_sync(held.entered.wait)
            tg.start_soon(submit, recorder(ran, "waiting"))
            await anyio.wait_all_tasks_blocked()
            tg.start_soon(anyio.to_thread.run_sync, worker.close)
            while not worker.closed:
                await anyio.lowlevel.checkpoint()
            held.open()
    finally:
        held.open()
    assert outcomes == ["a", "the model worker is closed"]
    assert ran == ["a"]
    assert worker.admitted == 0
    with pytest.raises(RuntimeError, match="closed"):
        await worker.call(recorder(ran, "late"))


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "2"])
def test_max_calls_must_be_a_positive_int(bad: object) -> None:
    with pytest.raises(ValueError, match="max_calls"):
        ModelWorker(None, max_calls=bad)  # type: ignore[arg-type]


def test_a_call_whose_loop_closed_does_not_kill_the_model_thread() -> None:
    """Guards against `_serve` dying when `call_soon_threadsafe` raised on a loop already closed (its
    caller gone): every later call, from any loop, then waited for ever (uncancellably: a model call is
    never abandoned). The closed loop's result is dropped and the next call runs. The next call is made
    from a thread of its own so that, before the fix, the test fails instead of hanging."""
    worker = ModelWorker(None)
    closed = asyncio.new_event_loop()
    orphan = closed.create_future()
    closed.close()
    worker._jobs.append(_Job(closed, orphan, fn=lambda: "nobody waits"))  # queued before the thread starts
    got: list[str] = []
    caller = threading.Thread(
        target=lambda: got.append(asyncio.run(worker.call(lambda: "served"))), daemon=True
    )
    caller.start()
    caller.join(30)  # a hang guard, not a timing: the call returns within the model thread's next turn
    assert got == ["served"], "the model thread died on the closed loop's call"
    assert not orphan.done()
    worker.close()
