"""The loop pacer: concurrent prefetches take their admission, launch and commit stages one per loop
iteration (issue 12: sixteen of them in one iteration stalled the event loop for 30 ms).

Iterations are told apart with the loop's public API, no private hook: `LoopTurns.stamp()` schedules a
callback (`call_soon`, run at the loop's next iteration) and returns how many such callbacks have run, so
two stamps are equal exactly when no loop iteration passed between them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import anyio
import pytest
from controller_helpers import PassThroughBackend, make_config, prefetch_together, store_sequence, tokens

from hicache import HiCache, Namespace
from hicache.controller.prefetch.pacing import LoopPacer
from storage_backends.memory import MemoryBackend
from storage_backends.protocol import PageStatus


class LoopTurns:
    """Tells the event loop's iterations apart through `call_soon` (see the module docstring)."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._ran = 0

    def _witness(self) -> None:
        self._ran += 1

    @property
    def now(self) -> int:
        """A stamp of the current iteration: equal stamps were taken with no iteration between them."""
        stamp = self._ran
        self._loop.call_soon(self._witness)
        return stamp


@pytest.fixture
async def iterations() -> LoopTurns:
    return LoopTurns()


async def test_callers_arriving_together_take_their_turns_in_distinct_iterations_in_order(
    iterations: LoopTurns,
) -> None:
    """Eight callers ready in one iteration resume from `turn` one per iteration, first come first served."""
    pacer = LoopPacer()
    seen: list[tuple[int, int]] = []

    async def caller(i: int) -> None:
        await pacer.turn()
        seen.append((i, iterations.now))

    async with anyio.create_task_group() as tg:
        for i in range(8):
            tg.start_soon(caller, i)
    assert [i for i, _ in seen] == list(range(8))
    assert len({at for _, at in seen}) == 8
    assert (pacer.turns, pacer.queued, pacer.waiting) == (8, 7, 0)


async def test_queued_callers_resume_oldest_ticket_first(iterations: LoopTurns) -> None:
    """A caller showing an older ticket goes ahead of callers queued before it with newer ones; a caller
    without a ticket takes a new one (after every ticket handed out before)."""
    pacer = LoopPacer()
    old, new = pacer.ticket(), pacer.ticket()
    seen: list[str] = []

    async def caller(name: str, ticket: int | None) -> None:
        await pacer.turn(ticket)
        seen.append(name)

    async with anyio.create_task_group() as tg:
        tg.start_soon(caller, "first, holds the turn", None)
        tg.start_soon(caller, "no ticket", None)
        tg.start_soon(caller, "new", new)
        tg.start_soon(caller, "old", old)
    assert seen == ["first, holds the turn", "old", "new", "no ticket"]


async def test_an_idle_pacer_hands_a_turn_out_without_yielding(iterations: LoopTurns) -> None:
    """A lone caller does not wait a loop iteration: an idle cache's prefetch is not slowed."""
    pacer = LoopPacer()
    before = iterations.now
    await pacer.turn()
    assert iterations.now == before
    assert (pacer.turns, pacer.queued) == (1, 0)


async def test_a_caller_asking_again_right_after_its_turn_waits_for_the_next_iteration(
    iterations: LoopTurns,
) -> None:
    """No second turn in the iteration of the last queued waiter, even as the queue drains."""
    pacer = LoopPacer()
    seen: list[int] = []

    async def caller() -> None:
        for _ in range(3):
            await pacer.turn()
            seen.append(iterations.now)

    async with anyio.create_task_group() as tg:
        tg.start_soon(caller)
        tg.start_soon(caller)
    assert len(seen) == 6
    assert len(set(seen)) == 6


async def test_a_waiter_cancelled_before_its_turn_gives_its_place_up(iterations: LoopTurns) -> None:
    """The queue moves on past a cancelled waiter; the pacer goes idle once it is drained."""
    pacer = LoopPacer()
    seen: list[str] = []
    cancelled: list[str] = []
    scopes: dict[str, anyio.CancelScope] = {}

    async def caller(name: str) -> None:
        with anyio.CancelScope() as scope:
            scopes[name] = scope
            await pacer.turn()
            seen.append(name)
        if scope.cancelled_caught:
            cancelled.append(name)

    async with anyio.create_task_group() as tg:
        for name in "abcd":
            tg.start_soon(caller, name)
        await anyio.wait_all_tasks_blocked()
        assert (seen, pacer.waiting) == (["a"], 3)  # "a" found the pacer idle; the others queued
        scopes["c"].cancel()
    assert (seen, cancelled) == (["a", "b", "d"], ["c"])
    await asyncio.sleep(0)
    await asyncio.sleep(0)  # the pacer finds its queue drained and goes idle
    before = iterations.now
    await pacer.turn()
    assert iterations.now == before  # idle again: no wait


async def test_a_waiter_cancelled_at_its_turn_consumes_it_and_the_queue_moves_on(
    iterations: LoopTurns,
) -> None:
    """A waiter whose turn was handed out and that is cancelled (natively: an anyio scope lets a task whose
    wait is over run on) before it runs: the queue does not stall on it, and the pacer still goes idle."""
    tasks: dict[str, asyncio.Task[None]] = {}
    seen: list[str] = []

    class CancelsAtTheFirstHandOut(LoopPacer):
        handed_to_b = False

        def _hand_on(self) -> None:
            super()._hand_on()
            if not self.handed_to_b:  # the first hand-out resumes "b": cancel it before it runs
                self.handed_to_b = True
                tasks["b"].cancel()

    pacer = CancelsAtTheFirstHandOut()

    async def caller(name: str) -> None:
        await pacer.turn()
        seen.append(name)

    for name in "abc":
        tasks[name] = asyncio.get_running_loop().create_task(caller(name))
    with anyio.fail_after(5):
        done = await asyncio.gather(*tasks.values(), return_exceptions=True)
    assert seen == ["a", "c"]
    assert isinstance(done[1], asyncio.CancelledError)
    assert pacer.waiting == 0
    for _ in range(3):
        await asyncio.sleep(0)  # the pacer finds its queue drained and goes idle
    before = iterations.now
    await pacer.turn()
    assert iterations.now == before


class ProbeRecorder(PassThroughBackend):
    """Records the loop iteration in which each storage lookup is submitted; reads wait for `gate`."""

    def __init__(self, inner: MemoryBackend, iterations: LoopTurns) -> None:
        super().__init__(inner)
        self.iterations = iterations
        self.lookups: list[int] = []
        self.reads: list[int] = []
        """The loop iteration in which each read was submitted."""
        self.gate = anyio.Event()

    async def exists(self, keys: Sequence[str]) -> int:
        self.lookups.append(self.iterations.now)
        return await self.inner.exists(keys)

    async def get(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[PageStatus]:
        self.reads.append(self.iterations.now)
        await self.gate.wait()
        return await self.inner.get(keys, buffers)


async def test_prefetches_started_together_are_admitted_and_committed_one_per_iteration(
    iterations: LoopTurns,
) -> None:
    """Eight prefetches started in one iteration: their page hashing (then their storage lookups) and,
    once their reads all finish in one iteration, their commits each run in an iteration of their own.
    Guards against the 30 ms loop stall of sixteen admissions in one iteration (issue 12)."""
    config = make_config(
        host_pages=256, storage_batch_pages=4, prefetch_stop_policy="wait_complete", prefetch_threshold=4
    )
    async with MemoryBackend(namespace_digest=Namespace(model_id="controller-tests").digest) as inner:
        backend = ProbeRecorder(inner, iterations)
        async with HiCache(config, storage=backend) as cache:  # type: ignore[arg-type]
            seqs = [tokens(1000 * i, 32) for i in range(8)]
            for seq in seqs:
                await store_sequence(inner, cache, seq)
            committed: list[tuple[int, int]] = []

            async def one(i: int) -> None:
                prefetch = await cache.prefetch(f"r{i}", seqs[i])
                assert prefetch is not None
                outcome = await cache.commit_prefetch(f"r{i}")
                committed.append((outcome.loaded_tokens, iterations.now))

            async with anyio.create_task_group() as tg:
                for i in range(8):
                    tg.start_soon(one, i)
                await anyio.wait_all_tasks_blocked()  # every prefetch streams, its reads held at the gate
                assert len(backend.lookups) == 8
                backend.gate.set()  # every read finishes in the same iteration
            assert len(set(backend.lookups)) == 8
            # Oldest first: the first prefetch's allocation and launch go ahead of the first stages of the
            # prefetches started after it, so the read threads get work before every lookup is made
            # (first come first served, its first read waited for all eight lookups).
            assert min(backend.reads) < max(backend.lookups)
            assert [loaded for loaded, _ in committed] == [32] * 8
            assert len({at for _, at in committed}) == 8
            assert cache.statistics().prefetches_in_flight == 0
            cache.sanity_check()


async def test_a_second_prefetch_with_the_same_request_id_is_refused_while_the_first_is_admitted() -> None:
    """Two prefetches for one request id started in one iteration: the first holds the id across its
    turn and admission (its storage probe awaits), so the second is refused with a ValueError naming
    `request_id`, not launched over the first (whose pages would then be tracked by nothing)."""
    config = make_config(host_pages=64, prefetch_stop_policy="wait_complete", prefetch_threshold=4)
    digest = Namespace(model_id="controller-tests").digest
    async with MemoryBackend(namespace_digest=digest) as inner, HiCache(config, storage=inner) as cache:
        seq = tokens(0, 32)
        await store_sequence(inner, cache, seq)
        free_before = cache.statistics().host_pool.free_pages
        results: list[object] = []

        async def start() -> None:
            try:
                results.append(await cache.prefetch("same", seq))
            except ValueError as error:
                results.append(error)

        async with anyio.create_task_group() as tg:  # the first awaits its storage probe meanwhile
            tg.start_soon(start)
            tg.start_soon(start)
        errors = [r for r in results if isinstance(r, ValueError)]
        assert len(errors) == 1
        assert "request_id" in str(errors[0])
        outcome = await cache.commit_prefetch("same")
        assert outcome.loaded_tokens == 32
        assert cache.statistics().prefetches_in_flight == 0
        cache.sanity_check()
        assert cache.statistics().host_pool.free_pages == free_before - 8  # one refill's pages, no more


async def test_prefetches_started_together_never_exceed_the_capacity_between_them() -> None:
    """Two 32-token prefetches started in one iteration under a 40-token capacity: each awaits its
    storage probe and its allocation turn before it is in flight, so a capacity check that counted only
    the launched ones would pass both. The first's remainder counts from its check on: one is skipped."""
    config = make_config(host_pages=64, prefetch_threshold=8, prefetch_capacity_tokens=40)
    digest = Namespace(model_id="controller-tests").digest
    async with MemoryBackend(namespace_digest=digest) as inner, HiCache(config, storage=inner) as cache:
        seqs = [tokens(0, 32), tokens(1000, 32)]
        for seq in seqs:
            await store_sequence(inner, cache, seq)
        admitted = await prefetch_together(cache, seqs)
        assert len(admitted) == 1
        assert cache.statistics().prefetch_tokens_in_flight == 32
        await cache.cancel_prefetch(admitted[0])
        assert cache.statistics().prefetches_in_flight == 0
        cache.sanity_check()
