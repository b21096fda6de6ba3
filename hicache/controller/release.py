"""The release queue: host buffers handed back asynchronously, in batches, once no I/O can touch them."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import anyio
import anyio.lowlevel
import torch

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


class ReleaseQueue:
    """Returns host buffers to their pools in the background, `batch_tokens` at a time.

    `release()` never awaits: the caller enqueues and goes on; a worker started with `run()` frees the
    buffers between event-loop turns so a large release never stalls the serving loop. `drain()` waits
    until everything enqueued has been freed; `flush()` frees everything now (used when closing).
    """

    def __init__(self, host_pool: IndexPool, *, batch_tokens: int) -> None:
        if batch_tokens < 1:
            raise ValueError(f"batch_tokens: must be >= 1, got {batch_tokens}")
        self._host_pool = host_pool
        self._batch_tokens = batch_tokens
        self._pending: deque[ReleaseBatch] = deque()
        self._pending_tokens = 0
        self._released_calls = 0
        self._released_tokens = 0
        self._wakeup = anyio.Event()
        self._idle = anyio.Event()
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
            self._idle = anyio.Event()
        self._wakeup.set()
        return batch

    def pending_transfer_slots(self, pool: IndexPool) -> int:
        """Indices of component transfers into `pool` still waiting to be freed."""
        return sum(
            int(t.indices.numel()) for batch in self._pending for t in batch.transfers if t.pool is pool
        )

    def pending_indices(self, pool: object) -> list[torch.Tensor]:
        """Every index into `pool` still waiting to be freed (the host pages and component transfers)."""
        out = [batch.host_indices for batch in self._pending] if pool is self._host_pool else []
        out.extend(t.indices for batch in self._pending for t in batch.transfers if t.pool is pool)
        return out

    def statistics(self) -> ReleaseStatistics:
        """Pending and released calls and tokens."""
        return ReleaseStatistics(
            pending_calls=len(self._pending),
            pending_tokens=self._pending_tokens,
            released_calls=self._released_calls,
            released_tokens=self._released_tokens,
        )

    def __repr__(self) -> str:
        s = self.statistics()
        return (
            f"<ReleaseQueue pending={s.pending_calls} calls/{s.pending_tokens} tokens "
            f"released={s.released_calls} calls/{s.released_tokens} tokens>"
        )

    async def run(self) -> None:
        """The worker: frees pending batches step by step until cancelled."""
        while True:
            await self._wakeup.wait()
            self._wakeup = anyio.Event()
            while self._pending:
                self._step()
                await anyio.lowlevel.checkpoint()
            self._idle.set()

    async def drain(self) -> None:
        """Wait until every enqueued release has been carried out."""
        await self._idle.wait()

    def flush(self) -> None:
        """Free everything pending right now, synchronously."""
        while self._pending:
            self._step()
        self._idle.set()

    def _step(self) -> None:
        batch = self._pending[0]
        n = batch.num_tokens
        if n > self._batch_tokens:
            # Free the head of a large batch and keep the rest queued; transfers go with the last piece.
            head, rest = batch.host_indices[: self._batch_tokens], batch.host_indices[self._batch_tokens :]
            self._host_pool.free(head)
            self._pending[0] = ReleaseBatch(rest, batch.transfers)
            self._pending_tokens -= int(head.numel())
            self._released_tokens += int(head.numel())
            return
        self._pending.popleft()
        if n:
            self._host_pool.free(batch.host_indices)
        for transfer in batch.transfers:
            transfer.pool.free(transfer.indices)
        self._pending_tokens -= n
        self._released_tokens += n
        self._released_calls += 1
