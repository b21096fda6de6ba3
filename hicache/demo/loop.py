"""The demo's asyncio serving loop: simulated users over one model, with a `HiCache` and without one.

`ServingLoop` runs every user's conversation through the cache (a runner subclass serves each request under
its lease), then the very same prompts again with full recompute and no cache, for the time-to-first-token
comparison and the recompute check. Forward passes run in one model thread (`ModelWorker`, one model), so
the event loop keeps serving cache I/O while the model computes, and the model never waits for the loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from functools import partial
from typing import Any, Generic, TypeVar

import torch

from hicache.controller import HiCache, Lease
from hicache.demo.model import Steps
from hicache.demo.records import ProgressFn, RequestRecord, Served
from hicache.demo.worker import ModelWorker
from hicache.demo.workload import Session, Workload
from hicache.errors import LoadBackFailed

__all__ = ["ServingLoop"]

ModelT = TypeVar("ModelT")

_LOAD_BACK_ATTEMPTS = 4
"""How often one request is served before its failing load-backs end the run (a copy that keeps failing
is a broken device, not a transient fault)."""
T = TypeVar("T")


class ServingLoop(Generic[ModelT]):
    """State and user loops shared by the demo runners: one model, a running-slot limit, the records.

    A runner subclasses this and implements `_run` (one request through the cache under its lease, which
    it releases); the user loops with the cache, the no-cache recompute run and the model worker thread
    are here. The model must offer `prefill(prompt, None)` and `decode_steps(prefill, steps)` returning objects
    with `tokens` and `logits`.

    Args:
        model: the model the requests run on.
        workload: the seeded workload.
        max_running: requests in flight at once.
        torch_threads: intra-op threads for the model's forward passes (`None` leaves torch's setting).
        progress: called as requests complete, per phase.
        lockstep: serve one request at a time and let the cache settle in between (see `serve_cached`).
    """

    def __init__(
        self,
        model: ModelT,
        workload: Workload,
        max_running: int,
        torch_threads: int | None,
        progress: ProgressFn,
        lockstep: bool = False,
    ) -> None:
        self.model = model
        self.lockstep = lockstep
        self.workload = workload
        self.progress = progress
        # Bounded above what the requests need (each has at most one call in it, under `running`), so
        # they never wait for room; anything past that waits.
        self.worker = ModelWorker(torch_threads, max_calls=2 * max_running)
        """The model thread every forward pass runs in (`close` stops it)."""
        self.running = asyncio.Semaphore(max_running)
        self.records: list[RequestRecord] = []
        self.extra_requests = 0
        """Requests served besides the workload's turns (a scenario's own), for the progress totals."""
        self.load_back_failures = 0
        """Requests whose prefix failed to load back (`LoadBackFailed`) and were served again."""
        self.t0 = 0.0

    async def compute(self, fn: Callable[[], Any]) -> Any:
        """Run one model call in the model thread, in arrival order (waiting for it even if cancelled)."""
        return await self.worker.call(fn)

    async def compute_steps(self, steps: Steps[T]) -> T:
        """Run a model call cut into steps (a decode), one step per turn of the model thread.

        A request that arrives meanwhile waits for one step, not for a whole decode, before its prefill
        runs: as in a server that interleaves prefills with other requests' decoding.
        """
        return await self.worker.steps(steps)

    # ------------------------------------------------------------------ with the cache

    async def serve_cached(self, cache: HiCache) -> None:
        """Serve every user's conversation through `cache`, recording each request.

        In lockstep, one request at a time (turn by turn, users in arrival order, no pauses), and the cache
        finishes its backups and storage writes before the next request: which tier each hit comes from
        then depends on the workload only, not on timing.
        """
        if not self.lockstep:
            async with asyncio.TaskGroup() as tg:
                for conversation in self.workload.conversations:
                    tg.create_task(self._user_cached(cache, Session(self.workload, conversation)))
            return
        sessions = [Session(self.workload, conversation) for conversation in self.workload.conversations]
        while any(not session.done for session in sessions):
            for session in sessions:
                if not session.done:
                    await self._turn_cached(cache, session)
                    await cache.wait_idle()

    async def _user_cached(self, cache: HiCache, session: Session) -> None:
        conv = session.conversation
        await asyncio.sleep(conv.start_delay_s)
        while not session.done:
            turn = session.turn
            await self._turn_cached(cache, session)
            await asyncio.sleep(conv.think_times_s[turn])

    async def _turn_cached(self, cache: HiCache, session: Session) -> None:
        """Serve the session's next turn through `cache` and record it."""
        conv = session.conversation
        prompt = session.next_prompt()
        turn = session.turn
        record = await self._serve_recorded(cache, f"u{conv.user}t{turn}", conv.user, turn, prompt)
        session.record_reply(prompt, record.reply)

    async def _serve_recorded(
        self, cache: HiCache, request_id: str, user: int, turn: int, prompt: torch.Tensor
    ) -> RequestRecord:
        """Serve one request through `cache` (arriving now), record it and report progress."""
        arrival = time.perf_counter()
        async with self.running:
            record = await self._serve_one(cache, request_id, user, turn, prompt, arrival)
        self.records.append(record)
        self.progress("cache", len(self.records), self.workload.num_requests + self.extra_requests)
        return record

    async def _serve_one(
        self, cache: HiCache, request_id: str, user: int, turn: int, prompt: torch.Tensor, arrival: float
    ) -> RequestRecord:
        t_acquire = time.perf_counter()
        lease: Lease = await cache.acquire(request_id, prompt)
        acquire_s = time.perf_counter() - t_acquire
        for attempt in range(1, _LOAD_BACK_ATTEMPTS + 1):
            try:
                served = await self._run(cache, lease, request_id, prompt, arrival)
                break
            except LoadBackFailed as exc:
                # The prefix's layer-wise load-back failed (`_run` released the lease): its pages left the
                # device, so the next acquire finds what is left (the host copy, or nothing) and recomputes
                # the rest. Only this request is retried; the other users' requests go on meanwhile.
                self.load_back_failures += 1
                if attempt == _LOAD_BACK_ATTEMPTS:
                    raise LoadBackFailed(
                        f"{request_id}: the prefix failed to load back {attempt} times in a row"
                    ) from exc
                lease = await cache.acquire(request_id, prompt)
                acquire_s = time.perf_counter() - t_acquire
        return RequestRecord(
            request_id=request_id,
            user=user,
            turn=turn,
            prompt=prompt,
            cached_len=lease.cached_len,
            reused_len=served.reused,
            hits=dict(lease.hit_tokens_by_tier),
            prefetch=lease.prefetch.status if lease.prefetch is not None else None,
            inserted=served.inserted,
            arrival_s=arrival - self.t0,
            ttft_s=served.ttft,
            reply=served.reply,
            logits=served.logits,
            restored_kv=served.restored_kv,
            queue_s=t_acquire - arrival,
            acquire_s=acquire_s,
            prefetch_rescued=lease.prefetch is not None and lease.prefetch.rescued,
        )

    async def _run(
        self, cache: HiCache, lease: Lease, request_id: str, prompt: torch.Tensor, arrival: float
    ) -> Served:
        """Serve one request under `lease` (which this releases) and insert what it computed."""
        raise NotImplementedError

    # ------------------------------------------------------------------ without a cache

    async def serve_recompute(self) -> None:
        """Serve the recorded prompts again with full recompute and no cache, comparing the replies."""
        by_user: dict[int, list[RequestRecord]] = {}
        for record in sorted(self.records, key=lambda r: (r.user, r.turn)):
            by_user.setdefault(record.user, []).append(record)
        done = [0]
        if self.lockstep:  # the cached run's order, one request at a time
            for record in sorted(self.records, key=lambda r: (r.turn, r.user)):
                await self._recompute_one(record, done)
            return
        async with asyncio.TaskGroup() as tg:
            for conv in self.workload.conversations:
                tg.create_task(
                    self._user_recompute(conv.start_delay_s, conv.think_times_s, by_user[conv.user], done)
                )

    async def _user_recompute(
        self, delay: float, think: tuple[float, ...], records: list[RequestRecord], done: list[int]
    ) -> None:
        await asyncio.sleep(delay)
        for record in records:
            await self._recompute_one(record, done)
            await asyncio.sleep(think[record.turn])

    async def _recompute_one(self, record: RequestRecord, done: list[int]) -> None:
        """Serve `record`'s prompt with full recompute and compare the reply."""
        steps = self.workload.spec.decode_tokens
        model: Any = self.model
        arrival = time.perf_counter()
        record.arrival_nocache_s = arrival - self.t0
        async with self.running:
            record.queue_nocache_s = time.perf_counter() - arrival
            prefill = await self.compute(partial(model.prefill, record.prompt, None))
            record.ttft_nocache_s = time.perf_counter() - arrival
            decoded = await self.compute_steps(model.decode_steps(prefill, steps))
        record.reply_equal = decoded.tokens == record.reply
        record.recompute_max_diff = float((decoded.logits - record.logits).abs().max())
        done[0] += 1
        self.progress("recompute", done[0], len(self.records))

    # ------------------------------------------------------------------ checks 1 and 2

    def verify(self) -> None:
        """Run checks 1 and 2 on every record (in the worker thread)."""
        raise NotImplementedError
