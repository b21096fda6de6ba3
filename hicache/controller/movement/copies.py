"""Device <-> host copies that are counted and never abandoned, and the load-backs in flight."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import torch

from hicache.memory import KVPool, copy_pages_async

__all__ = ["CopyTracker"]


class CopyTracker:
    """Runs device <-> host copies and knows which are in flight.

    `aclose` closes no pool while a copy may still write into it (load-backs in the caller's own tasks
    included), and the ownership check finds the device pages a load-back copies into (`loading`).
    """

    def __init__(self) -> None:
        self.count = 0
        """Copies in flight, the caller's load-backs included."""
        self.limiter: asyncio.Semaphore | None = None
        """Bounds the copies that run or enqueue in worker threads at once (None: unbounded)."""
        self._idle: asyncio.Event | None = None
        self._loading: dict[int, tuple[KVPool, torch.Tensor]] = {}

    async def copy(
        self, src: KVPool, src_indices: torch.Tensor, dst: KVPool, dst_indices: torch.Tensor
    ) -> None:
        """`copy_pages_async`, counted and never abandoned: a cancellation is re-raised only once the copy
        has landed."""
        self.begin()
        try:
            await copy_pages_async(src, src_indices, dst, dst_indices, limiter=self.limiter)
        finally:
            self.end()

    def begin(self) -> None:
        """Count a copy that runs outside `copy` (a layer-wise load-back's task)."""
        self.count += 1

    def end(self) -> None:
        """The copy counted by `begin` has landed (or failed)."""
        self.count -= 1
        if not self.count and self._idle is not None:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Wait until no copy is in flight."""
        while self.count:
            self._idle = asyncio.Event()  # set by the last copy to finish
            await self._idle.wait()

    def track_load(self, pool: KVPool, indices: torch.Tensor) -> None:
        """Note device pages (tagged `Owner.COPY`) a load-back copies into."""
        self._loading[id(indices)] = (pool, indices)

    def untrack_load(self, indices: torch.Tensor) -> None:
        """The load-back into `indices` is over (attached, or freed)."""
        self._loading.pop(id(indices), None)

    def loading(self, pool: KVPool) -> Iterator[torch.Tensor]:
        """Indices of `pool` that load-backs in flight copy into."""
        return (indices for (p, indices) in self._loading.values() if p is pool)
