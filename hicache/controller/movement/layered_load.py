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

A copy that fails, or is cancelled (the loop shutting down) before it landed, must not leave its pages
in the tree: they hold bytes that are no node's KV. The load then stops the copy and waits until no thread
writes into them, revokes the readiness (every `wait_layer` of it raises `LoadBackFailed` from then on),
takes the pages out of the device tier (`RadixTree.drop_failed_load`, whatever locks them) and frees
them once; a lease on them can only be released (`insert` raises `LoadBackFailed`), and its holder
recomputes. Every way out, cancellation at any await included, unlocks the load's nodes exactly once. A
task ended without waiting for its copy (an exception other than a cancellation) cannot free the pages
yet: they are poisoned at once, stay locked and in flight, and are dropped once the copy settled.
Nodes that a holder below keeps on the device (a locked device-only child, a backup in flight below, a
host-only child of a device-only node) cannot leave: the tree poisons them (no match reaches them or
below, and they are never backed up from the device: they hold their host copy), and after a copy failure
the loader copies their host values into their pages once more; when that lands they are hits again.

Under tensor parallelism (`agreement` given) the readers get an `AgreedLayerReadiness` (every rank's
`wait_layer(i)` returns, or raises, alike) and the load lands or fails at the agreement step that
resolves its `AgreedLoad`, on every rank alike, not when this rank's copy ends
(`hicache.parallel.layer_readiness`).

A cache with hybrid components loads them whole (`TierMover.load_back`): a component value (a window, a
state) is not split by layer.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hicache.controller.movement.copies import CopyTracker
from hicache.controller.movement.tier_mover import TierMover
from hicache.errors import LoadBackFailed
from hicache.keys import TOKEN_BYTES
from hicache.memory import KVPool, Owner
from hicache.memory.layerwise import (
    ALL_READY,
    CpuLayerReadiness,
    CudaLayerReadiness,
    HeldReadiness,
    LayerReadiness,
    LayerwiseCopy,
    all_of,
)
from hicache.metrics import CacheMetrics
from hicache.parallel.agreement import Agreement
from hicache.parallel.layer_readiness import AgreedLayerReadiness, AgreedLoad
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
        agreement: the tensor-parallel agreement (None for one rank): each load's outcome and its
            layers' readiness are then agreed (its group must have a `readiness` group).
    """

    def __init__(
        self,
        tree: RadixTree,
        device_pool: KVPool,
        host_pool: KVPool,
        mover: TierMover,
        copies: CopyTracker,
        metrics: CacheMetrics,
        agreement: Agreement | None = None,
    ) -> None:
        self._agreement = agreement
        self._tree = tree
        self._device_pool = device_pool
        self._host_pool = host_pool
        self._mover = mover
        self._copies = copies
        self._metrics = metrics
        self._in_flight: dict[int, _Load] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.before_layer: Callable[[int], None] | None = None
        """Called in the copying thread before each layer (tests hold a layer back with it)."""

    @property
    def in_flight(self) -> int:
        """Layer-wise load-backs whose copy has not landed yet."""
        return len(self._in_flight)

    def readiness_for(self, device_indices: torch.Tensor) -> HeldReadiness:
        """The readiness of device pages `device_indices`: of every in-flight load that copies into one of
        them (`ALL_READY` when none does), checking `layer` the same way whatever is in flight."""
        num_layers = self._device_pool.layout.num_layers
        if not self._in_flight or not device_indices.numel():
            return HeldReadiness(ALL_READY, num_layers)
        return HeldReadiness(
            all_of(
                [
                    load.readiness if load.agreed is None else load.agreed.layers
                    for load in self._in_flight.values()
                    if bool(torch.isin(load.device_indices, device_indices).any())
                ]
            ),
            num_layers,
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
            self._device_pool.free(device_indices)  # from `alloc_device`: the caller's until attached
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
        self._start(_Load(copy, _LoadReadiness(copy.readiness), key, start, device_indices, last))
        self._metrics.load_back_tokens.inc(length)
        fresh = attached.match
        return LayerwiseLoad(fresh, self.readiness_for(fresh.device_indices))

    def _start(self, load: _Load) -> None:
        """Run `load`'s copy in a task of its own (its nodes are locked by the caller, for `_finish`)."""
        self._in_flight[id(load)] = load
        self._copies.begin()
        if self._agreement is not None:
            self._agree(load)
        task = asyncio.get_running_loop().create_task(self._run(load), name="hicache-layerwise-load")
        self._tasks.add(task)
        # A task cancelled before its first step never runs `_run`'s cleanup: the callback does it then.
        task.add_done_callback(lambda done: self._after(done, load))

    async def _run(self, load: _Load) -> None:
        """Run the copy to its end (a task of its own: no caller's cancellation abandons it), then finish.

        Every way out finishes the load exactly once (`_finish`): landed, failed (`LoadBackFailed`, logged),
        or cancelled at any await (the loop shutting down); a cancellation or failure first stops the copy
        and waits until no thread writes into the pages any more.
        """
        try:
            await load.copy.run(limiter=self._copies.limiter)
        except BaseException as exc:
            load.copy.abort()
            await load.copy.wait_settled()
            self._copy_ended(load, exc)
            if isinstance(exc, Exception):
                return  # logged by `_finish`; the model hears of it from `wait_layer`
            raise
        # CUDA: its last event too, before `landed` is judged (one rank) or the ranks may agree a drop;
        # a CPU copy's thread has returned: settled, no await.
        await load.copy.wait_settled()
        self._copy_ended(load, None)

    def _agree(self, load: _Load) -> None:
        """Under TP: propose the load's agreed outcome (at the engine call that attached it, or the step
        that dropped the load it copies again, on every rank alike) and give its readers the agreed
        readiness. Once the agreement failed (the group is gone) a load finishes on its own copy."""
        agreement = self._agreement
        assert agreement is not None
        assert agreement.group is not None
        readiness = agreement.group.readiness
        assert readiness is not None, "checked by HiCacheConfig"
        if agreement.failed is not None:
            return
        copy = load.copy
        layers = AgreedLayerReadiness(
            copy.readiness, readiness, copy.readiness.num_layers, revoked=lambda: load.readiness.revoked
        )
        outcome = AgreedLoad(
            agreement,
            f"{load.start}+{load.device_indices.numel()}",
            settled=lambda: copy.settled,
            finish=lambda landed: self._finish(load, None if landed else _not_everywhere(), landed=landed),
        )
        load.agreed = _Agreed(outcome, layers)

    def _copy_ended(self, load: _Load, error: BaseException | None) -> None:
        """This rank's copy settled: finish the load (one rank), or settle its agreed outcome (TP; the
        ranks' agreement may have finished the load already, once the copy had settled)."""
        if load.agreed is None:
            self._finish(load, error)
        else:
            if load.state is _LoadState.COPYING:
                load.enter(_LoadState.AGREEING)
            inner = load.readiness.inner
            load.agreed.outcome.settle(error is None and inner.is_ready(inner.num_layers - 1))

    def _after(self, task: asyncio.Task[None], load: _Load) -> None:
        """The task's done callback: finish a load whose task ended without `_run`'s cleanup (cancelled
        before it ran, or ended by an exception other than a cancellation while it waited for its copy)."""
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("layer-wise load-back task ended abnormally: %r", task.exception())
        if load.state is _LoadState.COPYING:  # `_copy_ended` never ran
            load.copy.abort()
            self._copy_ended(load, asyncio.CancelledError())

    def _finish(self, load: _Load, error: BaseException | None, *, landed: bool | None = None) -> None:
        """End `load` once: unlock its nodes and, unless every layer landed (`landed`, when the ranks
        agreed it; else this rank's copy), take its pages out of the device tier (see
        `RadixTree.drop_failed_load`) and free them, so no later match finds them.

        A load that did not land while its copy may still write (its task ended without waiting for the
        copy) is not finished yet: `_defer` hides its pages and finishes it once the copy settled."""
        if load.state is _LoadState.FINISHED:
            return
        inner = load.readiness.inner
        if landed is None:
            landed = load.copy.settled and inner.is_ready(inner.num_layers - 1)
        if not landed and not load.copy.settled:
            if load.state is not _LoadState.DEFERRED:
                self._defer(load, error)
            return
        load.enter(_LoadState.FINISHED)
        self._in_flight.pop(id(load), None)
        try:
            if not landed:
                self._drop(load, error)
            elif load.recopy:
                self._tree.clear_poison(load.key, load.start, load.device_indices)
            if load.orphaned is not None:
                self._free_orphaned(load)
        finally:
            self._tree.unlock_host(load.last)
            self._tree.unlock_device(load.last)
            self._copies.end()

    def _defer(self, load: _Load, error: BaseException | None) -> None:
        """`load` did not land and its copy may still write into its pages (its task ended without
        waiting for it): fail and revoke its readiness and hide its pages now (poisoned: no match serves
        them); they stay locked (nothing evicts and reuses them) and in flight (a failed load above
        orphans rather than frees them) until the copy settled, then `_finish` drops them as usual."""
        load.enter(_LoadState.DEFERRED)
        load.copy.abort()
        self._revoke(load, error)
        hidden = self._tree.poison_load(load.key, load.start, load.device_indices)
        logger.error(
            "layer-wise load-back ended with its copy running; %d node(s) unmatched until it settled", hidden
        )
        self._finish_when_settled(load, error)

    def _finish_when_settled(self, load: _Load, error: BaseException | None) -> None:
        """In a task of its own: wait until no thread writes into `load`'s pages (cancellations are
        absorbed), then finish it as a load that did not land (its readers were told so already). A task
        that ended without finishing it (cancelled before its first step) is replaced."""

        async def wait_then_finish() -> None:
            await load.copy.wait_settled()
            self._finish(load, error, landed=False)

        def after(task: asyncio.Task[None]) -> None:
            self._tasks.discard(task)
            if load.state is _LoadState.FINISHED:
                return
            if load.copy.settled:
                self._finish(load, error, landed=False)
            else:
                self._finish_when_settled(load, error)

        task = asyncio.get_running_loop().create_task(wait_then_finish(), name="hicache-layerwise-settle")
        self._tasks.add(task)
        task.add_done_callback(after)

    def _revoke(self, load: _Load, error: BaseException | None) -> None:
        """Fail `load`'s readiness with `error` (or `LoadBackFailed`) and revoke it."""
        cause = error if error is not None else LoadBackFailed("layer-wise copy did not land")
        load.readiness.inner.fail(cause)
        load.readiness.revoke()

    def _drop(self, load: _Load, error: BaseException | None) -> None:
        """The copy did not land (and has settled): fail and revoke the readiness, then drop the pages from
        the tree."""
        assert load.copy.settled, "a load dropped while its copy may still write (see `_defer`)"
        self._revoke(load, error)
        if isinstance(error, Exception):
            logger.error("layer-wise load-back failed: %r", error)
        freed, kept = self._tree.drop_failed_load(load.key, load.start, load.device_indices)
        assert not freed.component_frees, "a layer-wise load-back loads no components"
        self._device_pool.free(self._orphan_loads_below(freed.freed_device), owner=Owner.TREE)
        if not kept:
            return
        if load.recopy or not isinstance(error, Exception):
            # Copying again failed too, or the loop is shutting down: they stay poisoned (no match
            # reaches them) until their holders let go and eviction takes their device pages.
            logger.error(
                "layer-wise load-back failed under %d node(s) held below it; they stay on the device, "
                "unmatched, until evicted",
                len(kept),
            )
            return
        self._recopy(load, kept)

    def _recopy(self, failed: _Load, kept: tuple[NodeRef, ...]) -> None:
        """Copy the host values of `failed`'s nodes that a holder below kept on the device (poisoned,
        root first) into their device pages again, once; when that lands they are hits again
        (`RadixTree.clear_poison`). Locked until then, so their pages stay theirs; nothing matches them
        meanwhile, so no reader waits for the copy."""
        tree = self._tree
        infos = [tree.node_info(ref) for ref in kept]
        host: list[torch.Tensor] = []
        device: list[torch.Tensor] = []
        for info in infos:
            assert info.host_value is not None
            assert info.device_value is not None
            host.append(info.host_value)
            device.append(info.device_value)
        device_indices = torch.cat(device)
        copy = LayerwiseCopy(
            self._host_pool,
            torch.cat(host),
            self._device_pool,
            device_indices,
            before_layer=self.before_layer,
        )
        last = kept[-1]
        tree.lock_device(last)
        tree.lock_host(last)
        load = _Load(
            copy, _LoadReadiness(copy.readiness), failed.key, failed.start, device_indices, last, recopy=True
        )
        logger.warning("layer-wise load-back failed under %d node(s) held below it; copying again", len(kept))
        self._start(load)

    def _orphan_loads_below(self, dropped: torch.Tensor) -> torch.Tensor:
        """Of the pages a failed load took out of the tree, those free to go now.

        A load below it (a longer request that matched through its pages while it was in flight and
        loaded the rest of its prefix) may still copy into some of them: those stay allocated, tagged as
        a copy's destination, until that load settled (`_free_orphaned`); it is aborted and its readiness
        revoked (its readers read through the failed prefix anyway).
        """
        for other in self._in_flight.values():
            mine = torch.isin(dropped, other.device_indices)
            if not bool(mine.any()):
                continue
            pages = dropped[mine]
            dropped = dropped[~mine]
            other.orphaned = pages
            other.copy.abort()
            other.readiness.revoke()
            self._device_pool.set_owner(pages, Owner.COPY)
            self._copies.track_load(self._device_pool, pages)
        return dropped

    def _free_orphaned(self, load: _Load) -> None:
        """Free the pages a failed load above `load` took out of the tree while `load` copied into them."""
        pages = load.orphaned
        assert pages is not None
        assert load.copy.settled, "only a settled load finishes (see `_defer`)"
        self._copies.untrack_load(pages)
        self._device_pool.free(pages, owner=Owner.COPY)


def _not_everywhere() -> LoadBackFailed:
    return LoadBackFailed("the layer-wise copy did not land on every tensor-parallel rank")


class _LoadState(enum.Enum):
    """Where a layer-wise load is in its life. Its copy's own progress is the copy's (`LayerwiseCopy`)."""

    COPYING = "copying"
    """Its copy runs, or settled without `_copy_ended` having run yet."""
    AGREEING = "agreeing"
    """Under TP: this rank's copy settled and was settled into the agreed outcome, which decides."""
    DEFERRED = "deferred"
    """It did not land and its copy may still write: hidden, finished once the copy settled (`_defer`)."""
    FINISHED = "finished"
    """Unlocked, and landed or dropped; nothing happens to it any more."""


_NEXT_STATES: dict[_LoadState, frozenset[_LoadState]] = {
    _LoadState.COPYING: frozenset({_LoadState.AGREEING, _LoadState.DEFERRED, _LoadState.FINISHED}),
    _LoadState.AGREEING: frozenset({_LoadState.DEFERRED, _LoadState.FINISHED}),
    _LoadState.DEFERRED: frozenset({_LoadState.FINISHED}),
    _LoadState.FINISHED: frozenset(),
}


@dataclass(frozen=True)
class _Agreed:
    """Under TP: a load's outcome, agreed by the ranks (it finishes when that resolves), and the readiness
    its readers get instead of this rank's own."""

    outcome: AgreedLoad
    layers: AgreedLayerReadiness


@dataclass(eq=False)
class _Load:
    """One layer-wise load-back in flight: its copy, its readiness, where its pages went, its lock."""

    copy: LayerwiseCopy
    readiness: _LoadReadiness
    key: bytes
    start: int
    device_indices: torch.Tensor
    last: NodeRef
    recopy: bool = False
    """A second copy into a failed load's pages that a holder below kept (poisoned) on the device."""
    state: _LoadState = field(default=_LoadState.COPYING, init=False)
    orphaned: torch.Tensor | None = None
    """Its pages a failed load above it took out of the tree while it copied (freed once it finished)."""
    agreed: _Agreed | None = None
    """Under TP (set when it starts, unless the agreement had failed): see `_Agreed`."""

    def enter(self, state: _LoadState) -> None:
        """Move to `state`, one of the states that may follow the current one."""
        assert state in _NEXT_STATES[self.state], f"a layer-wise load cannot go {self.state} -> {state}"
        self.state = state

    @property
    def finished(self) -> bool:
        """Whether it is `FINISHED`."""
        return self.state is _LoadState.FINISHED

    @property
    def deferred(self) -> bool:
        """Whether it is `DEFERRED`."""
        return self.state is _LoadState.DEFERRED


class _LoadReadiness(LayerReadiness):
    """A load's readiness: its copy's, until the load failed and its pages left the device tier; from then
    on every layer raises `LoadBackFailed` (the pages are no longer the reader's KV)."""

    def __init__(self, inner: CpuLayerReadiness | CudaLayerReadiness) -> None:
        self.inner = inner
        self._revoked = False

    def revoke(self) -> None:
        """The load failed and its pages left the tree: no layer may be read any more."""
        self._revoked = True

    @property
    def revoked(self) -> bool:
        """Whether `revoke` was called."""
        return self._revoked

    def _check(self, layer: int) -> None:
        if self._revoked:
            raise LoadBackFailed(
                f"layer {layer}: the layer-wise load-back failed and its pages left the device; recompute"
            )

    def wait_layer(self, layer: int) -> None:
        self._check(layer)
        self.inner.wait_layer(layer)  # raises LoadBackFailed for a layer the failed copy never landed
        self._check(layer)

    def is_ready(self, layer: int) -> bool:
        return not self._revoked and self.inner.is_ready(layer)

    @property
    def done(self) -> bool:
        return self._revoked or self.inner.done

    def __repr__(self) -> str:
        return "<LayerReadiness revoked>" if self._revoked else repr(self.inner)
