"""Layer-wise load-back under tensor parallelism: per-layer readiness that every rank agrees on.

Each rank copies its slice of a load-back's KV layer by layer, and its model calls `wait_layer(i)` before
reading layer i. A copy that fails (or is slow) on one rank must not let the ranks' forward passes part:
if `wait_layer(i)` raised on one rank and returned on another, the second would run layer i and wait
forever in the model's own collective. So under TP the answer of `wait_layer(i)` is agreed:

* `wait_layer(i)` is a collective of the group's readiness group (`RankGroup.readiness`, a second
  process group: the cache's agreement steps run on the event loop meanwhile). Every rank's model calls
  it for the same layers in the same order (its forward pass does), so the collectives pair up.
* A rank first waits locally, in the model's thread (never the event loop), until its layer i landed
  (CPU: copied; CUDA: every layer's copy enqueued, the stream wait follows), its copy stopped short, or
  half the group timeout passed; then the ranks exchange how many layers landed on each (one
  collective, bounded by what is left of the group timeout) and every rank takes the minimum. So one
  `wait_layer` returns or raises within the group timeout.
* Layers below the agreed count are ready on every rank: later `wait_layer` calls for them return with
  no collective (the count is the same on every rank, so whether a call runs a collective never depends
  on a rank-local fact). A layer at or beyond a count that some rank reported short raises
  `LoadBackFailed` on every rank, now and for every later call of that layer or any above it; so does
  every layer at or beyond the agreed count once the rank that set it said its copy stopped there.
* A peer that died or stopped responding makes the collective raise `RankFailed` within the group
  timeout.

Whether the load's pages stay in the tree is agreed separately, as a decision of the cache's agreement
(`AgreedLoad`), settled by each rank once its copy has settled (1: every layer landed, 0: it did not)
and resolved at an agreement step inside an engine call, on every rank alike: there the load lands (its
nodes unlocked) or fails (its pages dropped from the device tier) on every rank. A copy that failed on
some rank leaves fewer than all layers landed there, so every forward pass through the load raises at
the same layer on every rank, at the latest at the last layer; the lease's `insert` then raises too. A
load dropped although every layer landed everywhere (its task cancelled after the copy, the agreement
failed) is revoked: a rank whose load was revoked offers no layer beyond those already agreed, so the next
readiness collective makes every rank raise, and no forward reads its freed pages for a layer not yet
agreed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from hicache.errors import LoadBackFailed
from hicache.memory.layerwise import CudaLayerReadiness, LayerReadiness
from hicache.parallel.agreement import Agreement, Decision
from hicache.parallel.decision import NONE
from hicache.parallel.group import RankGroup
from storage_backends.cancellation import run_in_thread

__all__ = ["AgreedLayerReadiness", "AgreedLoad"]

_POLL_S = (0.0001, 0.002)
"""First and longest sleep between two looks at a copy's local progress (the model's thread polls)."""


class AgreedLayerReadiness(LayerReadiness):
    """The readiness of a layer-wise load-back that every rank of a TP group agrees on (module docstring).

    Args:
        local: this rank's copy's readiness (`CpuLayerReadiness` or `CudaLayerReadiness`).
        group: the readiness group of the TP ranks (`RankGroup.readiness`).
        num_layers: the layers of the load.
        revoked: whether the load's pages left this rank's tree (dropped): this rank then offers no
            layer beyond those already agreed, so the next collective makes every rank raise alike.
    """

    def __init__(
        self,
        local: LayerReadiness,
        group: RankGroup,
        num_layers: int,
        *,
        revoked: Callable[[], bool] = lambda: False,
    ) -> None:
        self.local = local
        self._revoked = revoked
        self.group = group
        self.num_layers = num_layers
        self.collectives = 0
        """Readiness collectives this load ran (every rank runs the same number)."""
        # (layers ready on every rank, whether some rank reported fewer than asked for: then final),
        # swapped as one reference: the event loop reads it while the model's thread moves it on.
        self._state = (0, False)
        self._lock = threading.Lock()

    def _landed_here(self) -> int:
        """Layers of this rank's copy that a reader may use now: enqueued (CUDA) or copied (CPU), in order."""
        local = self.local
        if isinstance(local, CudaLayerReadiness):
            return len(local.events)
        landed = self._state[0]
        while landed < self.num_layers and local.is_ready(landed):
            landed += 1
        return landed

    def _wait_here(self, layer: int, deadline: float) -> tuple[int, bool]:
        """Wait (polling, until `deadline`) until this rank's layer `layer` landed or its copy stopped;
        return the layers landed here and whether its copy had stopped. CUDA waits for the whole enqueue
        (launches only), so one collective serves every layer."""
        want = self.num_layers if isinstance(self.local, CudaLayerReadiness) else layer + 1
        pause = _POLL_S[0]
        while True:
            if self._revoked():  # dropped here (every layer may have landed): no further layer
                return self._state[0], True
            # `done` before the count: a copy that stopped then has its final count. Read after it, a
            # copy finishing in between would report a stale count as where it stopped (failing the rest).
            stopped = self.local.done
            landed = self._landed_here()
            if landed >= want or stopped or time.monotonic() >= deadline:
                return landed, stopped
            time.sleep(pause)
            pause = min(pause * 2, _POLL_S[1])

    def wait_layer(self, layer: int) -> None:
        """Return once layer `layer` landed on every rank (on CUDA, the current stream then waits for its
        copy); a collective of the readiness group unless every rank already knows the answer. Returns
        or raises within the group timeout of the call (plus the lock wait behind another reader of this
        load): at most half of it waiting for this rank's copy, the rest for the peers in the collective.

        Raises:
            ValueError: naming `layer` when it is not a layer of the load.
            LoadBackFailed: the layer did not land on some rank (on every rank alike).
            RankFailed: a peer died or stopped responding within the group timeout.
        """
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer: expected an int in [0, {self.num_layers}), got {layer!r}")
        with self._lock:
            ready, short = self._state
            if layer >= ready and not short:
                started = time.monotonic()
                timeout_s = self.group.timeout_s
                landed, stopped_here = self._wait_here(layer, started + timeout_s / 2)
                # Also the least count of a rank whose copy stopped: if that is the agreed count, it is
                # final, and a later layer raises with no further collective.
                stopped = landed if stopped_here else NONE
                agreed, final = self.group.min_reduce(
                    torch.tensor([landed, stopped], dtype=torch.int64),
                    timeout_s=started + timeout_s - time.monotonic(),
                ).tolist()
                self.collectives += 1
                ready = max(ready, agreed)
                short = agreed < self.num_layers and (agreed <= layer or final <= agreed)
                self._state = (ready, short)
            if layer >= ready:
                raise LoadBackFailed(
                    f"layer {layer}: the layer-wise load-back did not land on every tensor-parallel rank "
                    f"(layers below {ready} did); recompute"
                )
        self.local.wait_layer(layer)  # CUDA: the stream wait; CPU: landed here, returns at once

    async def wait_layer_async(self, layer: int) -> None:
        """`wait_layer` in a worker thread (it may block in the collective): never blocks the loop."""
        await run_in_thread(self.wait_layer, layer)

    def is_ready(self, layer: int) -> bool:
        """Whether every rank agreed layer `layer` landed (only `wait_layer` moves this on)."""
        return layer < self._state[0]

    @property
    def done(self) -> bool:
        """Every layer agreed landed, or some rank agreed short (the same on every rank)."""
        ready, short = self._state
        return short or ready == self.num_layers

    def __repr__(self) -> str:
        ready, short = self._state
        return f"<AgreedLayerReadiness {ready}/{self.num_layers} layers agreed{' short' if short else ''}>"


class AgreedLoad:
    """The agreed outcome of one layer-wise load-back: whether its pages stay in the tree on every rank.

    Propose it where every rank is at the same point (the engine call that attached the load); `settle`
    it once this rank's copy has settled (no thread or kernel writes into its pages any more); `finish`
    runs inside the agreement step that resolves it, on every rank alike, with whether the load landed
    on every rank. When the agreement fails (a dead peer, the cache closing) `finish(False)` runs as soon
    as this rank's copy has settled.

    Args:
        agreement: the cache's agreement.
        key: what the load is about (the same on every rank).
        settled: whether this rank's copy has settled.
        finish: the tree's side: called once, with True (landed everywhere) or False.
    """

    def __init__(
        self,
        agreement: Agreement,
        key: str,
        *,
        settled: Callable[[], bool],
        finish: Callable[[bool], None],
    ) -> None:
        self._settled = settled
        self._finish = finish
        self._finished = False
        self.decision: Decision = agreement.propose("layer_load", key, on_resolve=self._on_resolve)

    def _on_resolve(self, agreed: int | None) -> None:
        if agreed is None and not self._settled():
            return  # the agreement failed with the copy still running: `settle` finishes it
        self._end(agreed == 1)

    def _end(self, landed: bool) -> None:
        if not self._finished:
            self._finished = True
            self._finish(landed)

    def settle(self, landed: bool) -> None:
        """This rank's copy has settled: every layer landed (`landed`) or not."""
        self.decision.settle(int(landed))
        if self.decision.resolved and self.decision.result is None:  # the agreement failed
            self._end(False)

    def __repr__(self) -> str:
        return f"AgreedLoad({self.decision!r})"
