"""Layer-wise load-back: host hits go back to the device layer by layer while the model already runs.

`TierMover.load_back` copies every layer before it returns. `LayeredLoader.load_back` instead starts the
copy in a task of its own and returns at once with the pages it copies into and their readiness: the
model calls `wait_layer(i)` before reading layer i, so the copy of later layers hides behind the compute
of earlier ones.

A landing load owns its device pages (tagged `Owner.COPY`): the tree does not know them until every layer
landed, so no match, eviction, backup or storage write ever sees them. The load holds a host lock on what
it copies from and a device lock on the device prefix above it. Its readers are the lease of the request
that started it and the leases of requests that matched the same host pages meanwhile: those share it
(its pages, its readiness, its outcome) instead of copying again, and a request whose host hit only
overlaps a landing load waits for it to end and matches again. When the last layer's copy ends (under
tensor parallelism: at the agreement step that resolves its `AgreedLoad`, on every rank alike) the load
lands: its pages are attached to the tree's device tier (`RadixTree.attach_loaded`) and it holds its
readers' device lock on them until the last one lets go; a page the tree did not take (a request inserted
the same prefix meanwhile) stays the load's until then.

The failure path: a load whose copy failed, or whose task was cancelled at any await, never touched the
tree, so failing it touches nothing there. It moves to `FAILED` once (every `wait_layer` of its readers
raises `LoadBackFailed` from then on, and their `insert` too: a host hit not delivered is never a hit),
drops its two locks, and gives its pages back to the device pool as soon as no thread or kernel writes
into them any more (at once when the copy settled, else from a task that waits until it has; a task
cancelled before it ran is replaced). Every way out, cancellation at any await included, ends the load
exactly once.

A cache with hybrid components loads them whole (`TierMover.load_back`): a component value (a window, a
state) is not split by layer.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hicache.controller.movement.copies import CopyTracker
from hicache.controller.movement.tier_mover import TierMover
from hicache.errors import LoadBackFailed
from hicache.keys import TOKEN_BYTES
from hicache.memory import KVPool, Owner
from hicache.memory.layerwise import ALL_READY, HeldReadiness, LayerReadiness, LayerwiseCopy
from hicache.metrics import CacheMetrics
from hicache.parallel.agreement import Agreement
from hicache.parallel.layer_readiness import AgreedLayerReadiness, AgreedLoad
from hicache.tree import MatchResult, NodeRef, RadixTree

__all__ = ["LayeredLoader", "LayerwiseLoad"]

logger = logging.getLogger("hicache.cache")

_NO_PAGES = torch.empty(0, dtype=torch.int64)


@dataclass(frozen=True)
class LayerwiseLoad:
    """What a layer-wise load-back returns.

    Attributes:
        match: the fresh match of the tree (the pages still landing are not in it).
        landing: the device pages of the host hit beyond `match.device_len`, still landing (empty when
            nothing is copied); the prefix's pages are `match`'s device indices, then these.
        layers: readiness of the prefix's layers: call `layers.wait_layer(i)` before reading layer i;
            `release` it when the request lets go (a reader's share of the load ends then).
    """

    match: MatchResult
    landing: torch.Tensor
    layers: HeldReadiness


class LayeredLoader:
    """Runs layer-wise load-backs and their readers.

    Args:
        tree: the radix tree (locks, and attaches a load that landed).
        device_pool, host_pool: the pools pages move between.
        mover: allocates device pages (evicting), and loads whole when layer-wise cannot be used.
        copies: counts the copies in flight (so `aclose` waits for them) and their pages.
        metrics: the cache's metric set (`load_back_tokens`, counted when a load lands).
        agreement: the ranks' agreement: each load's outcome is agreed with it (for one rank: as its
            copy settles), and across several ranks its layers' readiness too (the group must then have
            a `readiness` group).
    """

    def __init__(
        self,
        tree: RadixTree,
        device_pool: KVPool,
        host_pool: KVPool,
        mover: TierMover,
        copies: CopyTracker,
        metrics: CacheMetrics,
        agreement: Agreement,
    ) -> None:
        self._agreement = agreement
        self._tree = tree
        self._device_pool = device_pool
        self._host_pool = host_pool
        self._mover = mover
        self._copies = copies
        self._metrics = metrics
        self._num_layers = device_pool.layout.num_layers
        self._landing: dict[int, _Load] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.before_layer: Callable[[int], None] | None = None
        """Called in the copying thread before each layer (tests hold a layer back with it)."""

    @property
    def in_flight(self) -> int:
        """Layer-wise load-backs that have neither landed nor failed yet."""
        return len(self._landing)

    def ready(self) -> HeldReadiness:
        """The readiness of a prefix with nothing landing."""
        return HeldReadiness(ALL_READY, self._num_layers)

    async def load_back(self, match: MatchResult) -> LayerwiseLoad:
        """Load the host-only part of `match` back layer by layer; see the module docstring.

        With no host part, or no device room, nothing is copied (`landing` is empty); with hybrid
        components the match is loaded whole.
        """
        if self._tree.components:
            return LayerwiseLoad(await self._mover.load_back(match), _NO_PAGES, self.ready())
        tree = self._tree
        while match.host_len:
            shared = self._share(match)
            if shared is not None:
                return shared
            overlapping = self._overlapping(match)
            if overlapping is not None:  # it ends landed or failed; then the tree says what is left
                await self._wait_ended(overlapping)
                match = tree.match_prefix(match.key)
                continue
            start, length = match.device_len, match.host_len
            host_indices = match.host_indices
            above, last = match.last_device_node, match.host_nodes[-1]
            tree.lock_device(above)
            tree.lock_host(last)
            try:
                pages = await self._mover.alloc_device(length)
            except BaseException:
                tree.unlock_host(last)
                tree.unlock_device(above)
                raise
            current = tree.match_prefix(match.key)
            moved = not self._unchanged(current, start, host_indices)
            stale = moved or self._overlapping(current) is not None or self._agreement.failed is not None
            if pages is None or stale:
                # No room, or the tree moved while pages were found (a request inserted the prefix,
                # another load began there), or the agreement failed meanwhile (closing: the load could
                # not propose its outcome, and the next `alloc_device` raises): give them back, look again.
                tree.unlock_host(last)
                tree.unlock_device(above)
                if pages is None:
                    shared = self._share(current) if current.host_len else None
                    return shared or LayerwiseLoad(current, _NO_PAGES, self.ready())
                self._device_pool.free(pages)  # from `alloc_device`: the caller's until started
                match = current
                continue
            load = _Load(
                LayerwiseCopy(
                    self._host_pool, host_indices, self._device_pool, pages, before_layer=self.before_layer
                ),
                match.key,
                start,
                pages,
                above,
                last,
                agreement=self._agreement,
                finish=self._end,
            )
            self._device_pool.set_owner(pages, Owner.COPY)
            self._copies.track_load(self._device_pool, pages)
            self._start(load)
            return self._reader(load, current, 0, length)
        return LayerwiseLoad(match, _NO_PAGES, self.ready())

    @staticmethod
    def _unchanged(current: MatchResult, start: int, host_indices: torch.Tensor) -> bool:
        """Whether `current` still begins its host part at `start` with the pages `host_indices`."""
        length = int(host_indices.numel())
        return (
            current.device_len == start
            and current.host_len >= length
            and torch.equal(current.host_indices[:length], host_indices)
        )

    def _share(self, match: MatchResult) -> LayerwiseLoad | None:
        """A reader of the landing load whose span covers all of `match`'s host part, if there is one.

        Spans are compared by tokens (the same tokens from the root are the same nodes), so every rank of
        a TP group decides alike."""
        start, end = match.device_len, match.device_len + match.host_len
        for load in self._landing.values():
            if (
                load.start <= start
                and end <= load.end
                and load.key[: end * TOKEN_BYTES] == match.key[: end * TOKEN_BYTES]
            ):
                return self._reader(load, match, start - load.start, end - start)
        return None

    def _overlapping(self, match: MatchResult) -> _Load | None:
        """A landing load whose span overlaps `match`'s host part, if there is one."""
        start, end = match.device_len, match.device_len + match.host_len
        for load in self._landing.values():
            upto = min(end, load.end)
            if (
                max(start, load.start) < upto
                and load.key[: upto * TOKEN_BYTES] == match.key[: upto * TOKEN_BYTES]
            ):
                return load
        return None

    async def _wait_ended(self, load: _Load) -> None:
        """Wait until `load` landed or failed; an unresolved outcome is agreed here (every rank's engine
        call is at the same point, and sees the same loads; one rank's resolves as its copy settles)."""
        decision = load.outcome.decision
        if not decision.resolved and self._agreement.failed is None:
            await self._agreement.agree(decision)
        await load.ended.wait()

    def _reader(self, load: _Load, match: MatchResult, offset: int, n: int) -> LayerwiseLoad:
        """A new reader of `load`'s tokens [offset, offset + n), below `match`'s device prefix."""
        load.readers += 1
        reader = _Reader(load.layers, self._num_layers, load, self._drop_reader)
        return LayerwiseLoad(match, load.device_indices[offset : offset + n], reader)

    async def landed(self, layers: LayerReadiness) -> bool:
        """Whether the load that `layers` (a lease's) reads landed, once it has ended (True when they read
        no load). An unresolved outcome is agreed here: every rank's engine call is at the same point."""
        if not isinstance(layers, _Reader):
            return True
        await self._wait_ended(layers.load)
        return layers.load.state is _State.LANDED

    def _start(self, load: _Load) -> None:
        """Run `load`'s copy in a task of its own."""
        self._landing[id(load)] = load
        self._copies.begin()
        task = asyncio.get_running_loop().create_task(self._run(load), name="hicache-layerwise-load")
        self._tasks.add(task)
        # A task cancelled before its first step never runs `_run`: the callback ends the load then.
        task.add_done_callback(lambda done: self._after(done, load))

    async def _run(self, load: _Load) -> None:
        """Run the copy to its end and wait until it settled (cancellations are absorbed meanwhile), then
        end the load: landed, failed (`LoadBackFailed`, logged) or cancelled (re-raised)."""
        error: BaseException | None = None
        try:
            await load.copy.run(limiter=self._copies.limiter)
        except BaseException as exc:
            load.copy.abort()
            error = exc
        await load.copy.wait_settled()  # CUDA: its last event too
        self._copy_ended(load, error)
        if error is not None and not isinstance(error, Exception):
            raise error

    def _copy_ended(self, load: _Load, error: BaseException | None) -> None:
        """This rank's copy ended: settle the load's outcome (it ends when that resolves: for one rank at
        once, under TP at the agreement step that resolves it, on every rank alike)."""
        if load.state is not _State.COPYING:
            return
        load.error = error
        # Every layer landed and nothing writes any more: a cancellation after the last layer keeps them.
        landed = load.copy.settled and load.copy.readiness.is_ready(self._num_layers - 1)
        load.state = _State.AGREEING
        load.outcome.settle(landed)

    def _after(self, task: asyncio.Task[None], load: _Load) -> None:
        """The task's done callback: end a load whose task ended before `_copy_ended` (cancelled before it
        ran, or ended by an exception other than a cancellation while it waited for its copy)."""
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("layer-wise load-back task ended abnormally: %r", task.exception())
        if load.state is _State.COPYING:
            load.copy.abort()
            self._copy_ended(load, asyncio.CancelledError())

    def _end(self, load: _Load, landed: bool) -> None:
        """End `load` once: it lands (its pages join the tree) or fails (they go back to the pool)."""
        if load.state in (_State.LANDED, _State.FAILED):
            return
        del self._landing[id(load)]
        tree = self._tree
        if landed:
            load.state = _State.LANDED
            self._land(load)
        else:
            load.state = _State.FAILED
            cause = load.error or LoadBackFailed("the layer-wise copy did not land on every rank")
            load.copy.readiness.fail(cause)  # wakes a reader waiting on a layer that will never land
            if isinstance(load.error, Exception):
                logger.error("layer-wise load-back failed: %r", load.error)
            self._give_back(load, load.device_indices)
        tree.unlock_host(load.last)
        tree.unlock_device(load.above)
        load.ended.set()

    def _land(self, load: _Load) -> None:
        """Attach `load`'s pages to the tree; it keeps those the tree did not take (and a device lock on
        the rest) while it has readers."""
        tree = self._tree
        pages = load.device_indices
        self._copies.untrack_load(pages)
        self._device_pool.set_owner(pages, Owner.TREE)
        attached = tree.attach_loaded(load.key, load.start, pages)
        self._copies.end()
        self._metrics.load_back_tokens.inc(int(pages.numel()))
        spare = attached.freed_device
        if not load.readers:
            self._device_pool.free(spare, owner=Owner.TREE)
            return
        self._device_pool.set_owner(spare, Owner.COPY)
        load.spare = spare
        self._copies.track_load(self._device_pool, spare)
        load.held = tree.match_prefix(load.key[: load.end * TOKEN_BYTES]).last_device_node
        tree.lock_device(load.held)

    def _drop_reader(self, load: _Load) -> None:
        """A reader of `load` let go: the last one of a landed load ends its hold on the pages."""
        load.readers -= 1
        if load.readers or load.state is not _State.LANDED:
            return
        if load.held is not None:
            self._tree.unlock_device(load.held)
            load.held = None
        spare, load.spare = load.spare, _NO_PAGES
        self._copies.untrack_load(spare)
        self._device_pool.free(spare, owner=Owner.COPY)

    def _give_back(self, load: _Load, pages: torch.Tensor) -> None:
        """Free a failed load's pages once its copy settled: now, or from a task that waits for it (one
        cancelled before it ran is replaced by its done callback)."""
        if load.copy.settled:
            self._copies.untrack_load(pages)
            self._device_pool.free(pages, owner=Owner.COPY)
            self._copies.end()
            return
        logger.error("layer-wise load-back ended with its copy running; its pages go back once it settled")
        task = asyncio.get_running_loop().create_task(
            load.copy.wait_settled(), name="hicache-layerwise-settle"
        )
        self._tasks.add(task)

        def after(done: asyncio.Task[None]) -> None:
            self._tasks.discard(done)
            self._give_back(load, pages)

        task.add_done_callback(after)


class _State(enum.Enum):
    """Where a layer-wise load is in its life (its copy's own progress is the copy's)."""

    COPYING = "copying"
    """Its copy runs (or settled before `_copy_ended` ran)."""
    AGREEING = "agreeing"
    """This rank's copy settled into the load's outcome, which the ranks' agreement decides (for one
    rank at once)."""
    LANDED = "landed"
    """Its pages joined the tree's device tier."""
    FAILED = "failed"
    """It touched nothing in the tree; its pages go back to the pool (once its copy settled)."""


class _Load(LayerReadiness):
    """One layer-wise load-back: its copy, where it copies from and into, its locks and readers.

    As a readiness it is its copy's, until it failed: from then on every layer raises `LoadBackFailed`
    (its pages are no reader's KV any more). Its outcome is proposed when it is made (at the engine call
    that starts it, on every rank alike); `finish` ends it once that resolves.
    """

    def __init__(
        self,
        copy: LayerwiseCopy,
        key: bytes,
        start: int,
        device_indices: torch.Tensor,
        above: NodeRef,
        last: NodeRef,
        *,
        agreement: Agreement,
        finish: Callable[[_Load, bool], None],
    ) -> None:
        self.copy = copy
        self.key = key
        self.start = start
        self.device_indices = device_indices
        self.end = start + int(device_indices.numel())
        self.above = above
        """The last node of the device prefix above it (device-locked until it ended)."""
        self.last = last
        """The last host node it copies from (host-locked until it ended)."""
        self.state = _State.COPYING
        self.error: BaseException | None = None
        self.readers = 0
        self.held: NodeRef | None = None
        """Once landed with readers: the node device-locked for them."""
        self.spare = _NO_PAGES
        """Once landed with readers: its pages the tree did not take (freed with the last reader)."""
        self.ended = asyncio.Event()
        self.outcome = AgreedLoad(
            agreement,
            f"{start}+{device_indices.numel()}",
            settled=lambda: copy.settled,
            finish=lambda landed: finish(self, landed),
        )
        """Whether its pages stay in the tree: landed on every rank (1) or not."""
        self.layers: LayerReadiness = self
        """What its readers wait on: itself; under TP the ranks' agreed readiness instead, since a rank
        must not raise for a layer while its peers enter the readiness collective for it."""
        if not agreement.local:
            assert agreement.group is not None
            group = agreement.group.readiness
            assert group is not None, "checked by HiCacheConfig"
            num_layers = copy.readiness.num_layers
            self.layers = AgreedLayerReadiness(
                copy.readiness, group, num_layers, revoked=lambda: self.state is _State.FAILED
            )

    def _check(self, layer: int) -> None:
        if self.state is _State.FAILED:
            raise LoadBackFailed(
                f"layer {layer}: the layer-wise load-back failed and its pages went back; recompute"
            )

    def wait_layer(self, layer: int) -> None:
        self._check(layer)
        self.copy.readiness.wait_layer(layer)  # raises LoadBackFailed for a layer the copy never landed
        self._check(layer)

    def is_ready(self, layer: int) -> bool:
        return self.state is not _State.FAILED and self.copy.readiness.is_ready(layer)

    @property
    def done(self) -> bool:
        return self.state is _State.FAILED or self.copy.readiness.done

    def __repr__(self) -> str:
        return f"<layer-wise load {self.state.value} {self.copy.readiness!r}, {self.readers} reader(s)>"


class _Reader(HeldReadiness):
    """A lease's share of a load: its readiness, and the end of its share when the lease is released."""

    def __init__(
        self, inner: LayerReadiness, num_layers: int, load: _Load, drop: Callable[[_Load], None]
    ) -> None:
        super().__init__(inner, num_layers)
        self.load = load
        self._drop: Callable[[_Load], None] | None = drop

    def release(self, holder: str) -> None:
        super().release(holder)
        drop, self._drop = self._drop, None
        if drop is not None:
            drop(self.load)
