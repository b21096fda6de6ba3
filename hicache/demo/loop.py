"""The demo's asyncio serving loop: simulated users over one model, with a `HiCache` and without one.

`ServingLoop` runs every user's conversation through the cache (a runner subclass serves each request under
its lease), then the very same prompts again with full recompute and no cache, for the time-to-first-token
comparison and the recompute check. Forward passes run in a worker thread under one lock (one model), so
the event loop keeps serving cache I/O while the model computes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any, Generic, TypeVar

import anyio
import torch

from hicache.controller import HiCache, Lease
from hicache.demo.records import ProgressFn, RequestRecord, Served
from hicache.demo.workload import Session, Workload

__all__ = ["ServingLoop"]

ModelT = TypeVar("ModelT")


class ServingLoop(Generic[ModelT]):
    """State and user loops shared by the demo runners: one model, a running-slot limit, the records.

    A runner subclasses this and implements `_run` (one request through the cache under its lease, which
    it releases); the user loops with the cache, the no-cache recompute run and the model worker thread
    are here. The model must offer `prefill(prompt, None)` and `decode(prefill, steps)` returning objects
    with `tokens` and `logits`.

    Args:
        model: the model the requests run on.
        workload: the seeded workload.
        max_running: requests in flight at once.
        torch_threads: intra-op threads for the model's forward passes (`None` leaves torch's setting).
        progress: called as requests complete, per phase.
    """

    def __init__(
        self,
        model: ModelT,
        workload: Workload,
        max_running: int,
        torch_threads: int | None,
        progress: ProgressFn,
    ) -> None:
        self.model = model
        self.workload = workload
        self.progress = progress
        self.torch_threads = torch_threads
        self.model_lock = anyio.Lock()
        self.running = anyio.CapacityLimiter(max_running)
        self.records: list[RequestRecord] = []
        self.t0 = 0.0

    async def compute(self, fn: Callable[[], Any]) -> Any:
        """Run one model call in a worker thread, one at a time (waiting for it even if cancelled)."""
        threads = self.torch_threads

        def call() -> Any:
            # The thread count is per OS thread under OpenMP, so it is set in the worker itself.
            if threads is not None and torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
            return fn()

        async with self.model_lock:
            return await anyio.to_thread.run_sync(call)

    # ------------------------------------------------------------------ with the cache

    async def serve_cached(self, cache: HiCache) -> None:
        """Serve every user's conversation through `cache`, recording each request."""
        async with anyio.create_task_group() as tg:
            for conversation in self.workload.conversations:
                tg.start_soon(self._user_cached, cache, Session(self.workload, conversation))

    async def _user_cached(self, cache: HiCache, session: Session) -> None:
        conv = session.conversation
        await anyio.sleep(conv.start_delay_s)
        while not session.done:
            prompt = session.next_prompt()
            turn = session.turn
            arrival = time.perf_counter()
            async with self.running:
                record = await self._serve_one(
                    cache, f"u{conv.user}t{turn}", conv.user, turn, prompt, arrival
                )
            self.records.append(record)
            self.progress("cache", len(self.records), self.workload.num_requests)
            session.record_reply(prompt, record.reply)
            await anyio.sleep(conv.think_times_s[turn])

    async def _serve_one(
        self, cache: HiCache, request_id: str, user: int, turn: int, prompt: torch.Tensor, arrival: float
    ) -> RequestRecord:
        t_acquire = time.perf_counter()
        lease: Lease = await cache.acquire(request_id, prompt)
        acquire_s = time.perf_counter() - t_acquire
        served = await self._run(cache, lease, request_id, prompt, arrival)
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
            acquire_s=acquire_s,
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
        async with anyio.create_task_group() as tg:
            for conv in self.workload.conversations:
                tg.start_soon(
                    self._user_recompute, conv.start_delay_s, conv.think_times_s, by_user[conv.user], done
                )

    async def _user_recompute(
        self, delay: float, think: tuple[float, ...], records: list[RequestRecord], done: list[int]
    ) -> None:
        await anyio.sleep(delay)
        steps = self.workload.spec.decode_tokens
        model: Any = self.model
        for record in records:
            arrival = time.perf_counter()
            record.arrival_nocache_s = arrival - self.t0
            async with self.running:
                prefill = await self.compute(partial(model.prefill, record.prompt, None))
                record.ttft_nocache_s = time.perf_counter() - arrival
                decoded = await self.compute(partial(model.decode, prefill, steps))
            record.reply_equal = decoded.tokens == record.reply
            record.recompute_max_diff = float((decoded.logits - record.logits).abs().max())
            done[0] += 1
            self.progress("recompute", done[0], len(self.records))
            await anyio.sleep(think[record.turn])

    # ------------------------------------------------------------------ checks 1 and 2

    def verify(self) -> None:
        """Run checks 1 and 2 on every record (in the worker thread)."""
        raise NotImplementedError
