"""A commit cancelled by asyncio (`asyncio.timeout`, `Task.cancel`) after the ranks' agreement is carried
out whole, then the cancellation propagates; one cancelled before it leaves the prefetch as it was."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
from controller_helpers import make_config, store_sequence, tokens

from hicache import HiCache, Namespace
from hicache.controller.prefetch.job import Prefetch
from hicache.controller.prefetch.pacing import LoopPacer
from hicache.parallel.decision import Decision
from storage_backends.memory import MemoryBackend


@asynccontextmanager
async def stored_prefetch() -> AsyncIterator[tuple[HiCache, list[int], Prefetch]]:
    """A cache with a 32-token sequence in storage and its prefetch `"r"` in flight (wait_complete)."""
    config = make_config(host_pages=64, prefetch_stop_policy="wait_complete", prefetch_threshold=4)
    namespace = Namespace(model_id="controller-tests")
    async with (
        MemoryBackend(namespace_digest=namespace.digest) as backend,
        HiCache(config, storage=backend) as cache,
    ):
        seq = tokens(0, 32)
        await store_sequence(backend, cache, seq)
        prefetch = await cache.prefetch("r", seq)
        assert prefetch is not None
        yield cache, seq, prefetch


class ParksTheCommitTurn(LoopPacer):
    """A pacer whose turn parks its caller (as a queued turn would) for good."""

    def __init__(self) -> None:
        super().__init__()
        self.arrived = asyncio.Event()

    async def turn(self, ticket: int | None = None) -> None:
        self.arrived.set()
        await asyncio.Event().wait()


@pytest.mark.parametrize("how", ["asyncio.timeout", "task.cancel"])
async def test_a_commit_cancelled_in_its_turn_after_the_agreement_is_carried_out(how: str) -> None:
    """The pages were agreed across the ranks when the commit waits for its turn; anyio's shield there did
    not stop asyncio's own cancellation, which abandoned the commit with its decision consumed: the
    prefetch stayed in flight, a second commit failed with a KeyError, and under TP the ranks that had
    committed diverged from this one. Now the cancellation gives the turn up (it is only fairness among
    prefetches), never the commit: carried out at once, in the caller's task, then the cancellation
    propagates."""
    async with stored_prefetch() as (cache, seq, prefetch):
        async with asyncio.timeout(5):
            await prefetch.wait_for_stop_policy()  # read in full: the commit's is the next turn
        pacer = ParksTheCommitTurn()
        cache._prefetches.pacer = pacer
        deadline = asyncio.timeout(None)

        async def commit() -> None:
            async with deadline:
                await cache.commit_prefetch("r")

        loop = asyncio.get_running_loop()
        task = loop.create_task(commit())
        async with asyncio.timeout(5):
            await pacer.arrived.wait()  # the commit is parked in its turn, after the agreement
            assert cache.statistics().prefetches_in_flight == 1
            if how == "asyncio.timeout":
                deadline.reschedule(loop.time())
            else:
                task.cancel()
            (done,) = await asyncio.gather(task, return_exceptions=True)
        assert isinstance(done, TimeoutError if how == "asyncio.timeout" else asyncio.CancelledError)
        assert cache.statistics().prefetches_in_flight == 0  # resolved: committed, not abandoned
        assert cache.match(seq).host_len == 32
        cache.sanity_check()


async def test_a_commit_cancelled_before_the_agreement_leaves_the_prefetch_in_flight() -> None:
    """Cancelled while it waits for the stop policy (before the agreement): nothing is carried out, the
    prefetch stays in flight as it was, and a second commit completes it."""
    async with stored_prefetch() as (cache, seq, prefetch):
        stopped = asyncio.Event()
        real_wait = prefetch.wait_for_stop_policy

        async def parked_stop_policy() -> None:
            stopped.set()
            await asyncio.Event().wait()

        prefetch.wait_for_stop_policy = parked_stop_policy  # type: ignore[method-assign]
        task = asyncio.get_running_loop().create_task(cache.commit_prefetch("r"))
        async with asyncio.timeout(5):
            await stopped.wait()
        task.cancel()
        (done,) = await asyncio.gather(task, return_exceptions=True)
        assert isinstance(done, asyncio.CancelledError)
        assert cache.statistics().prefetches_in_flight == 1  # left as it was
        cache.sanity_check()
        prefetch.wait_for_stop_policy = real_wait  # type: ignore[method-assign]
        outcome = await cache.commit_prefetch("r")
        assert outcome.status == "committed"
        assert cache.match(seq).host_len == 32
        await cache.wait_idle()
        cache.sanity_check()


async def test_a_commit_cancelled_as_its_decision_resolves_is_carried_out() -> None:
    """The cancellation lands between the decision's resolving and the commit's wake-up (the waiter's
    future is done, so `Task.cancel` throws into it all the same): the ranks have decided, so the commit
    is carried out, then the cancellation propagates. It used to put the decision back and leave the
    prefetch in flight, and under TP this rank dropped pages its peers committed.

    The gap is N ranks': there the decision resolves in a step while the commit's local part runs in a
    task of its own. One rank runs that part in the commit's task (the decision resolves as it returns:
    no gap), so the agreement is made to take the task path here."""
    async with stored_prefetch() as (cache, seq, prefetch):
        agreement = cache._prefetches._agreement
        real_agree_on = agreement.agree_on

        async def agree_on_in_a_task(
            decision: Decision, local: Callable[[], Awaitable[int]], *, settles_early: bool = False
        ) -> int:
            return await real_agree_on(decision, local, settles_early=True)

        agreement.agree_on = agree_on_in_a_task  # type: ignore[method-assign]
        loop = asyncio.get_running_loop()
        task: asyncio.Task[object] | None = None
        real_wait_stopped = prefetch.wait_stopped

        async def stopped_then_cancel() -> None:
            await real_wait_stopped()
            assert task is not None
            # Runs before the commit's wake-up: this step settles (and on one rank resolves) the decision.
            loop.call_soon(task.cancel)

        prefetch.wait_stopped = stopped_then_cancel  # type: ignore[method-assign]
        task = loop.create_task(cache.commit_prefetch("r"))
        async with asyncio.timeout(5):
            (done,) = await asyncio.gather(task, return_exceptions=True)
        assert isinstance(done, asyncio.CancelledError)
        assert cache.statistics().prefetches_in_flight == 0  # resolved: committed, not left in flight
        assert cache.match(seq).host_len == 32
        cache.sanity_check()
