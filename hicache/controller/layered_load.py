"""Layer-wise load-back: host hits go back to the device layer by layer while the model already runs.

`TierMover.load_back` copies every layer before it returns. `LayeredLoader.load_back` instead attaches the
fresh device pages to the tree at once, starts the copy in a task of its own and returns a
`LayerReadiness`: the model calls `wait_layer(i)` before reading layer i, so the copy of later layers
hides behind the compute of earlier ones.

Pages attached before their copy landed are safe because:

* the load holds a device lock on the loaded prefix until the copy has landed, so nothing evicts them;
* loaded nodes are backed up already (they came from host), so no backup or storage write reads them;
* every other reader of them is a request whose `acquire` matched them: `readiness_for` hands it the
  in-flight load's readiness too (a caller of `HiCache.match` that reads device pages itself must ask
  `HiCache.layer_readiness`);
* `aclose` waits for the copy (it is counted in `CopyTracker.count`) before it closes a pool.

A cache with hybrid components loads them whole (`TierMover.load_back`): a component value (a window, a
state) is not split by layer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hicache.controller.copies import CopyTracker
from hicache.controller.tier_mover import TierMover
from hicache.keys import TOKEN_BYTES
from hicache.memory import KVPool, Owner
from hicache.memory.layerwise import ALL_READY, LayerReadiness, LayerwiseCopy, all_of
from hicache.metrics import CacheMetrics
from hicache.tree import MatchResult, NodeRef, RadixTree

__all__ = ["LayeredLoader", "LayerwiseLoad"]

logger = logging.getLogger("hicache.cache")


@dataclass(frozen=True)
class LayerwiseLoad:
    """What a layer-wise load-back returns.

    Attributes:
        match: the fresh match (its device prefix includes the pages still being copied).
        layers: readiness of the prefix's layers: call `layers.wait_layer(i)` before reading layer i.
    """

    match: MatchResult
    layers: LayerReadiness


class LayeredLoader:
    """Runs layer-wise load-backs and knows which device pages are still landing.

    Args:
        tree: the radix tree (attaches, locks).
        device_pool, host_pool: the pools pages move between.
        mover: allocates device pages (evicting), and loads whole when layer-wise cannot be used.
        copies: counts the copies in flight (so `aclose` waits for them).
        metrics: the cache's metric set (`load_back_tokens`).
    """

    def __init__(
        self,
        tree: RadixTree,
        device_pool: KVPool,
        host_pool: KVPool,
        mover: TierMover,
        copies: CopyTracker,
        metrics: CacheMetrics,
    ) -> None:
        self._tree = tree
        self._device_pool = device_pool
        self._host_pool = host_pool
        self._mover = mover
        self._copies = copies
        self._metrics = metrics
        self._in_flight: dict[int, tuple[torch.Tensor, LayerReadiness]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.before_layer: Callable[[int], None] | None = None
        """Called in the copying thread before each layer (tests hold a layer back with it)."""

    @property
    def in_flight(self) -> int:
        """Layer-wise load-backs whose copy has not landed yet."""
        return len(self._in_flight)

    def readiness_for(self, device_indices: torch.Tensor) -> LayerReadiness:
        """The readiness of device pages `device_indices`: of every in-flight load that copies into one of
        them (`ALL_READY` when none does)."""
        if not self._in_flight or not device_indices.numel():
            return ALL_READY
        return all_of(
            [
                readiness
                for indices, readiness in self._in_flight.values()
                if bool(torch.isin(indices, device_indices).any())
            ]
        )

    async def load_back(self, match: MatchResult) -> LayerwiseLoad:
        """Load the host-only part of `match` back layer by layer; see the module docstring.

        Returns the fresh match and the readiness of its device prefix (in-flight loads of other requests
        included). With no host part, or no device room, nothing is copied (the match comes back as
        `TierMover.load_back` would return it).
        """
        if match.host_len == 0 or self._tree.components:
            match = await self._mover.load_back(match)
            return LayerwiseLoad(match, self.readiness_for(match.device_indices))
        tree = self._tree
        start, length = match.device_len, match.host_len
        end = start + length
        key = match.key
        host_nodes = match.host_nodes
        tree.lock_device(match.last_device_node)
        tree.lock_host(host_nodes[-1])
        try:
            device_indices = await self._mover.alloc_device(length)
        finally:
            tree.unlock_host(host_nodes[-1])
            tree.unlock_device(match.last_device_node)
        if device_indices is None:
            return LayerwiseLoad(match, self.readiness_for(match.device_indices))
        current = tree.match_prefix(key[: end * TOKEN_BYTES])
        if current.device_len != start or current.host_nodes != host_nodes:
            # The tree moved while pages were found (a split, a concurrent load): not worth a layer-wise
            # plan of its own; give the pages back and load whole, which re-walks the tree.
            self._device_pool.free(device_indices)
            match = await self._mover.load_back(current)
            return LayerwiseLoad(match, self.readiness_for(match.device_indices))
        copy = LayerwiseCopy(
            self._host_pool,
            current.host_indices,
            self._device_pool,
            device_indices,
            before_layer=self.before_layer,
        )
        # Attached now, copied below: the pages are the tree's, locked by this load until they landed.
        # Nothing awaited since the check above, so the tree attaches every page (none to free).
        self._device_pool.set_owner(device_indices, Owner.TREE)
        attached = tree.attach_loaded(key, start, device_indices)
        assert not attached.freed_device.numel(), "the tree changed under a layer-wise attach"
        last = host_nodes[-1]
        tree.lock_device(last)
        tree.lock_host(last)
        token = id(copy)
        self._in_flight[token] = (device_indices, copy.readiness)
        self._copies.begin()
        task = asyncio.get_running_loop().create_task(
            self._run(copy, token, host_nodes), name="hicache-layerwise-load"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self._metrics.load_back_tokens.inc(length)
        fresh = attached.match
        return LayerwiseLoad(fresh, self.readiness_for(fresh.device_indices))

    async def _run(self, copy: LayerwiseCopy, token: int, nodes: tuple[NodeRef, ...]) -> None:
        """Run the copy to its end (a task of its own: no caller's cancellation abandons it), then unlock."""
        last = nodes[-1]
        try:
            await copy.run(limiter=self._copies.limiter)
        except Exception:
            # The readiness reports the failure to the model; the pages hold garbage, so they leave the
            # device tier where nothing else holds them (a lease that does has been told by `wait_layer`).
            logger.exception("layer-wise load-back failed")
            self._tree.unlock_host(last)
            self._tree.unlock_device(last)
            self._demote(nodes)
            return
        finally:
            self._in_flight.pop(token, None)
            self._copies.end()
        self._tree.unlock_host(last)
        self._tree.unlock_device(last)

    def _demote(self, nodes: tuple[NodeRef, ...]) -> None:
        """Drop the device copies of the loaded `nodes`, deepest first, as far as nothing else holds them."""
        for node in reversed(nodes):
            try:
                freed = self._tree.demote(node)
            except ValueError:  # locked by a lease, or a child on the device: it keeps its pages
                logger.error("layer-wise load-back failed under a held node %s", node.id)
                return
            self._device_pool.free(freed.freed_device)
