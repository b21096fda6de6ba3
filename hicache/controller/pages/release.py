"""The release queue: host buffers handed back asynchronously, in batches, once no I/O can touch them.

Buffers a stray storage thread may still touch (a read abandoned by a cancelled or timed-out call, see
`storage_backends.threads.stray_threads`) are quarantined first: held, never reused, and released
through the queue once the thread returns.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from hicache.memory import KVPool, Owner
from storage_backends.cancellation import StopScope
from storage_backends.threads import stray_threads

__all__ = ["ComponentTransfer", "IndexPool", "ReleaseBatch", "ReleaseQueue", "ReleaseStatistics"]

logger = logging.getLogger("hicache.release")


class IndexPool(Protocol):
    """Anything that takes token indices back: the host pool, a component's host pool."""

    def free(self, indices: torch.Tensor) -> None:
        """Return `indices` to the pool."""
        ...


@dataclass(frozen=True)
class ComponentTransfer:
    """The host buffers one component (sliding-window KV, Mamba state) staged for a prefetch.

    Attributes:
        component: the component's name.
        pool: the pool the indices belong to.
        indices: int64 indices into `pool`.
    """

    component: str
    pool: IndexPool
    indices: torch.Tensor


@dataclass(frozen=True)
class ReleaseBatch:
    """One release call: the host pages of a prefetch and every component transfer it staged, in order."""

    host_indices: torch.Tensor
    transfers: tuple[ComponentTransfer, ...] = ()

    @property
    def num_tokens(self) -> int:
        """Host tokens carried by this batch (component slots not counted)."""
        return int(self.host_indices.numel())


@dataclass(frozen=True)
class ReleaseStatistics:
    """What the release queue holds and has done."""

    pending_calls: int
    pending_tokens: int
    released_calls: int
    released_tokens: int
    quarantined_calls: int = 0
    """Release calls held back because a stray storage thread may still touch their buffers."""
    quarantined_tokens: int = 0
    """Host tokens of those calls (not yet pending, not reusable)."""


@dataclass
class _Quarantined:
    """Buffers held until no stray thread touches `views`; then `batch` is released and `on_quiet` runs."""

    batch: ReleaseBatch
    views: Sequence[memoryview]
    on_quiet: Callable[[], None] | None = field(default=None)


class ReleaseQueue:
    """Returns host buffers to their pools in the background, `batch_tokens` at a time.

    `release()` never awaits: the caller enqueues and goes on; a worker started with `run()` frees the
    buffers between event-loop turns so a large release never stalls the serving loop. `drain()` waits
    until everything enqueued has been freed; `flush()` frees everything now (used when closing).
    `quarantine()` holds buffers a stray storage thread may still touch; the worker (or `flush()`) checks
    them every `poll_s` seconds and releases each once its thread returned.
    """

    def __init__(self, host_pool: KVPool, *, batch_tokens: int, poll_s: float = 0.02) -> None:
        if batch_tokens < 1:
            raise ValueError(f"batch_tokens: must be >= 1, got {batch_tokens}")
        self._host_pool = host_pool
        self._batch_tokens = batch_tokens
        self._pending: deque[ReleaseBatch] = deque()
        self._pending_tokens = 0
        self._released_calls = 0
        self._released_tokens = 0
        self._quarantined: list[_Quarantined] = []
        self._quarantined_tokens = 0
        self._poll_s = poll_s
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self.history: list[ReleaseBatch] | None = None
        """When set to a list (tests), every release call is appended to it."""

    def release(
        self, host_indices: torch.Tensor, transfers: Sequence[ComponentTransfer] = ()
    ) -> ReleaseBatch:
        """Enqueue one release call: host pages plus component transfers, freed later in this order."""
        batch = ReleaseBatch(host_indices, tuple(transfers))
        if self.history is not None:
            self.history.append(batch)
        if batch.num_tokens == 0 and not batch.transfers:
            return batch
        self._pending.append(batch)
        self._pending_tokens += batch.num_tokens
        if self._idle.is_set():
            self._idle = asyncio.Event()
        self._wakeup.set()
        return batch

    def quarantine(
        self,
        host_indices: torch.Tensor,
        transfers: Sequence[ComponentTransfer] = (),
        *,
        views: Sequence[memoryview],
        on_quiet: Callable[[], None] | None = None,
    ) -> bool:
        """Release `host_indices` and `transfers` once no stray thread touches any of `views`.

        `views` are the buffers the caller passed to the abandoned storage call (pages of `host_indices`
        and of the transfers). When none is busy the release happens now, as `release()`. `on_quiet` runs
        (on the event loop) at that moment too: e.g. unlocking tree pages a stray write still reads.

        Returns:
            Whether the buffers were quarantined (False: released now).
        """
        batch = ReleaseBatch(host_indices, tuple(transfers))
        if not stray_threads.busy(views):
            self._settle(_Quarantined(batch, views, on_quiet))
            return False
        self._quarantined.append(_Quarantined(batch, tuple(views), on_quiet))
        self._quarantined_tokens += batch.num_tokens
        self._wakeup.set()
        return True

    def quarantined_host_indices(self) -> list[torch.Tensor]:
        """The host indices held in quarantine, one tensor per call (for exact page accounting)."""
        return [held.batch.host_indices for held in self._quarantined]

    def pending_transfer_slots(self, pool: IndexPool) -> int:
        """Indices of component transfers into `pool` still waiting to be freed (quarantined included)."""
        batches = [*self._pending, *(q.batch for q in self._quarantined)]
        return sum(int(t.indices.numel()) for batch in batches for t in batch.transfers if t.pool is pool)

    def pending_indices(self, pool: object) -> list[torch.Tensor]:
        """Every index into `pool` still waiting to be freed (the host pages and component transfers),
        quarantined ones included."""
        batches = [*self._pending, *(q.batch for q in self._quarantined)]
        out = [batch.host_indices for batch in batches] if pool is self._host_pool else []
        out.extend(t.indices for batch in batches for t in batch.transfers if t.pool is pool)
        return out

    def statistics(self) -> ReleaseStatistics:
        """Pending, quarantined and released calls and tokens."""
        return ReleaseStatistics(
            pending_calls=len(self._pending),
            pending_tokens=self._pending_tokens,
            released_calls=self._released_calls,
            released_tokens=self._released_tokens,
            quarantined_calls=len(self._quarantined),
            quarantined_tokens=self._quarantined_tokens,
        )

    def __repr__(self) -> str:
        s = self.statistics()
        return (
            f"<ReleaseQueue pending={s.pending_calls} calls/{s.pending_tokens} tokens "
            f"quarantined={s.quarantined_calls} calls/{s.quarantined_tokens} tokens "
            f"released={s.released_calls} calls/{s.released_tokens} tokens>"
        )

    def settle_quarantine(self) -> int:
        """Move every quarantined call whose stray threads returned to the pending releases; count them.

        Raises:
            Exception: the first an `on_quiet` callback raised (the other calls settled all the same).
        """
        if not self._quarantined:
            return 0
        still: list[_Quarantined] = []
        quiet: list[_Quarantined] = []
        for held in self._quarantined:
            (still if stray_threads.busy(held.views) else quiet).append(held)
        self._quarantined = still
        error: Exception | None = None
        for held in quiet:
            self._quarantined_tokens -= held.batch.num_tokens
            try:
                self._settle(held)
            except Exception as exc:
                error = error or exc
        if error is not None:
            raise error
        return len(quiet)

    def _settle(self, held: _Quarantined) -> None:
        if held.batch.num_tokens or held.batch.transfers:
            self.release(held.batch.host_indices, held.batch.transfers)
        if held.on_quiet is not None:
            held.on_quiet()

    async def run(self) -> None:
        """The worker: frees pending batches step by step, and settles the quarantine, until cancelled."""
        while True:
            if self._quarantined:
                async with StopScope(self._poll_s):
                    await self._wakeup.wait()
            else:
                await self._wakeup.wait()
            self._wakeup = asyncio.Event()
            self.settle_quarantine()
            while self._pending:
                self._step()
                await asyncio.sleep(0)
            self._idle.set()

    async def drain(self) -> None:
        """Wait until every enqueued release has been carried out."""
        await self._idle.wait()

    def flush(self) -> None:
        """Free everything pending (and every quarantined call whose threads returned) right now."""
        self.settle_quarantine()
        while self._pending:
            self._step()
        self._idle.set()

    def _step(self) -> None:
        """Free the head of the queue (at most `batch_tokens` host tokens). The queue moves on before
        anything is freed: a free that raises (a page freed twice) loses that piece, never stops the rest.
        """
        batch = self._pending.popleft()
        n = batch.num_tokens
        if n > self._batch_tokens:
            # Free the head of a large batch and keep the rest queued; transfers go with the last piece.
            head, rest = batch.host_indices[: self._batch_tokens], batch.host_indices[self._batch_tokens :]
            self._pending.appendleft(ReleaseBatch(rest, batch.transfers))
            self._pending_tokens -= int(head.numel())
            self._released_tokens += int(head.numel())
            self._host_pool.free(head, owner=Owner.RELEASE)
            return
        self._pending_tokens -= n
        self._released_tokens += n
        self._released_calls += 1
        frees: list[tuple[IndexPool, torch.Tensor]] = [(self._host_pool, batch.host_indices)] if n else []
        frees.extend((t.pool, t.indices) for t in batch.transfers)
        error: Exception | None = None
        for pool, indices in frees:
            try:
                if isinstance(pool, KVPool):  # tagged on its way here (`PrefetchReleaser`)
                    pool.free(indices, owner=Owner.RELEASE)
                else:
                    pool.free(indices)
            except Exception as exc:  # free the rest of the call, then raise the first
                error = error or exc
        if error is not None:
            raise error
