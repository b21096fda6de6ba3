"""Layer-wise page copies: a copy that completes one layer at a time, and the handle that says which.

A load-back copies host pages to the device in layer order, so that a model may run layer i's attention as
soon as layer i's K/V has arrived while later layers are still being copied: most of the copy then hides
behind compute. The handle, a `LayerReadiness`, has one operation for the model: `wait_layer(i)`, called
before reading layer i.

* CUDA: one event per layer, recorded on the copy's side stream in layer order. `wait_layer(i)` makes the
  caller's current stream wait for the event (`Stream.wait_event`): it returns at once on the host, and the
  model's kernels for layer i queue behind the copy of layer i. Nothing blocks a thread.
* CPU: the copy runs layer by layer in a worker thread and signals each layer through a
  `threading.Condition`. `wait_layer(i)` blocks the calling thread until layer i is copied, so it must be
  called from the model's thread (a worker thread), never on the event loop; `wait_layer_async` is there
  for the event loop.

Page-first pools keep one page's K/V of all layers contiguous (one storage object, one DMA per page). A
layer-wise copy reads them with a per-layer strided gather: for layer ``l`` the source is
``buffer[pages, l]``, one block of ``2 * page_size * heads * head_dim`` elements per page at a stride of
one page. The alternative, a layer-first host layout, would give contiguous per-layer runs but split every
page into `num_layers` pieces for storage and whole-page copies; the gather keeps storage and whole copies
as they are. Measured on CPU (`make bench-layerwise`, BENCHMARKS.md): the strided per-layer copy runs at
the same bandwidth as the whole-page copy for pages of a few KiB per layer and more. On CUDA the gather is
one kernel per layer reading pinned host memory through its mapped device view (`_mapped_host_view`),
falling back to a CPU gather into a pinned staging buffer plus one DMA per layer.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import numpy as np
import torch

from hicache.errors import LeaseReleased, LoadBackFailed
from hicache.memory.pool import KVPool
from hicache.memory.transfer import _POLL_INTERVAL_S, _mapped_host_view, _runs, _validated_pages, _wait_event
from storage_backends.cancellation import uncancellable

__all__ = [
    "ALL_READY",
    "CpuLayerReadiness",
    "CudaLayerReadiness",
    "HeldReadiness",
    "LayerReadiness",
    "LayerwiseCopy",
    "read_layer_tokens",
]


class LayerReadiness:
    """Which layers of a load-back have landed; complete (every layer ready) in this base class.

    Subclasses complete layer by layer. A model calls `wait_layer(i)` before it reads layer i's K/V.
    """

    def wait_layer(self, layer: int) -> None:
        """Return once layer `layer` may be read (see the module docstring for CPU and CUDA).

        Raises:
            LoadBackFailed: when the copy failed before this layer landed.
        """

    def is_ready(self, layer: int) -> bool:
        """Whether layer `layer` has landed (never blocks)."""
        return True

    @property
    def done(self) -> bool:
        """Whether every layer has landed (or the copy failed)."""
        return True

    async def wait_layer_async(self, layer: int) -> None:
        """`wait_layer` for the event loop: polls, never blocks it."""
        while True:
            if self.is_ready(layer) or self.done:
                break
            await asyncio.sleep(_POLL_INTERVAL_S)
        self.wait_layer(layer)  # raises if the copy failed; otherwise returns at once

    def __repr__(self) -> str:
        return "<LayerReadiness ready>"


ALL_READY = LayerReadiness()
"""The readiness of a prefix with nothing in flight."""


class CpuLayerReadiness(LayerReadiness):
    """Per-layer readiness of a copy that a worker thread runs layer by layer.

    Args:
        num_layers: layers the copy completes, in order.
    """

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self._ready = 0
        self._error: BaseException | None = None
        self._cond = threading.Condition()

    def mark_ready(self, layer: int) -> None:
        """Layer `layer` (the next in order) has landed; wakes its waiters."""
        with self._cond:
            assert layer == self._ready, f"layers complete in order: expected {self._ready}, got {layer}"
            self._ready = layer + 1
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """The copy failed: every waiter on a layer not yet landed raises `LoadBackFailed`."""
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def wait_layer(self, layer: int) -> None:
        _check_layer(layer, self.num_layers)
        with self._cond:
            self._cond.wait_for(lambda: self._ready > layer or self._error is not None)
            if self._ready <= layer:
                raise LoadBackFailed(f"load-back failed before layer {layer} landed") from self._error

    def is_ready(self, layer: int) -> bool:
        _check_layer(layer, self.num_layers)
        return self._ready > layer

    @property
    def done(self) -> bool:
        return self._ready == self.num_layers or self._error is not None

    def __repr__(self) -> str:
        failed = " failed" if self._error is not None else ""
        return f"<CpuLayerReadiness {self._ready}/{self.num_layers} layers{failed}>"


class CudaLayerReadiness(LayerReadiness):
    """Per-layer readiness of a CUDA copy: one event per layer, recorded on the copy stream in order.

    Args:
        events: the events, layer by layer (filled in by the copy as it enqueues each layer).
        num_layers: layers the copy completes.
    """

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.events: list[torch.cuda.Event] = []
        self._enqueued = threading.Event()  # set once every layer's event is recorded
        self._error: BaseException | None = None

    def fail(self, error: BaseException) -> None:
        """The copy failed or was abandoned: a waiter on a layer whose event was never recorded raises
        `LoadBackFailed` (instead of waiting for an enqueue that will not come)."""
        self._error = error
        self._enqueued.set()

    def wait_layer(self, layer: int) -> None:
        """Make the caller's current CUDA stream wait for layer `layer`'s copy; returns at once.

        Raises:
            LoadBackFailed: when enqueueing the copy failed before this layer's event was recorded.
        """
        _check_layer(layer, self.num_layers)
        self._enqueued.wait()  # the enqueue of a copy is short: its launches, never the copy itself
        if layer >= len(self.events):
            raise LoadBackFailed(f"load-back failed before layer {layer} was enqueued") from self._error
        event = self.events[layer]
        torch.cuda.current_stream(event.device).wait_event(event)

    def is_ready(self, layer: int) -> bool:
        _check_layer(layer, self.num_layers)
        if not self._enqueued.is_set() or layer >= len(self.events):
            return False
        return bool(self.events[layer].query())  # type: ignore[no-untyped-call]

    @property
    def done(self) -> bool:
        """Every layer landed, or the enqueue stopped short of one (a failed copy)."""
        if not self._enqueued.is_set():
            return False
        if len(self.events) < self.num_layers:
            return True
        return bool(self.events[-1].query())  # type: ignore[no-untyped-call]

    def __repr__(self) -> str:
        return f"<CudaLayerReadiness {len(self.events)}/{self.num_layers} layers enqueued>"


class HeldReadiness(LayerReadiness):
    """The readiness a caller is handed (a lease's `layers`): `inner`'s, with
    `layer` checked against the layout whatever `inner` is (complete, or still landing), and refused once
    the lease it belongs to was released (its pages may hold another request's KV by then).

    Args:
        inner: what says which layers landed.
        num_layers: the layout's layers.
    """

    def __init__(self, inner: LayerReadiness, num_layers: int) -> None:
        self.inner = inner
        self.num_layers = num_layers
        self._released: str | None = None

    def release(self, holder: str) -> None:
        """`holder` (a lease) was released: every later `wait_layer`/`is_ready` raises `LeaseReleased`."""
        self._released = holder

    def _check(self, layer: int) -> None:
        _check_layer(layer, self.num_layers)
        if self._released is not None:
            raise LeaseReleased(
                f"layer {layer}: {self._released} was released; its pages are no longer its KV"
            )

    def wait_layer(self, layer: int) -> None:
        """`LayerReadiness.wait_layer`.

        Raises:
            ValueError: naming `layer` when it is not an int in ``[0, num_layers)``.
            LeaseReleased: once the lease was released.
            LoadBackFailed: when the copy failed before this layer landed.
        """
        self._check(layer)
        self.inner.wait_layer(layer)

    def is_ready(self, layer: int) -> bool:
        self._check(layer)
        return self.inner.is_ready(layer)

    @property
    def done(self) -> bool:
        return self.inner.done

    async def wait_layer_async(self, layer: int) -> None:
        self._check(layer)
        await self.inner.wait_layer_async(layer)
        self._check(layer)  # released while it waited

    def __repr__(self) -> str:
        released = f" ({self._released} released)" if self._released is not None else ""
        return f"<HeldReadiness {self.inner!r}{released}>"


def _check_layer(layer: int, num_layers: int) -> None:
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < num_layers:
        raise ValueError(f"layer: expected an int in [0, {num_layers}), got {layer!r}")


def read_layer_tokens(pool: KVPool, indices: torch.Tensor, layer: int) -> torch.Tensor:
    """Gather layer `layer` of tokens `indices` from `pool`: a new tensor ``(planes, n, heads, head_dim)``.

    The per-layer counterpart of `KVPool.read_tokens` (whose result's `[layer]` this equals bit for bit).

    Raises:
        TypeError: when `indices` is not a 1-D int64 CPU tensor.
        ValueError: when an index or `layer` is out of range.
    """
    _check_layer(layer, pool.layout.num_layers)
    pages, offsets = pool._token_coords(indices, "indices")
    return pool.buffer[pages, layer, :, offsets].permute(1, 0, 2, 3).contiguous()


class LayerwiseCopy:
    """A copy of whole pages from `src` to `dst` that lands layer by layer; `readiness` says which.

    Create it, hand `readiness` to the model, then `await run()` (once). A cancellation of `run` aborts the
    copy (it stops before its next layer) and propagates at once, its thread (and on CUDA its kernels) maybe
    still running: before `dst`'s pages go elsewhere the owner awaits `wait_settled()`.

    Args:
        src: the pool read from (the host pool, for a load-back).
        src_indices: token indices of whole, aligned pages of `src`.
        dst: the pool written to.
        dst_indices: token indices of whole, aligned pages of `dst`, as many as `src_indices`.
        before_layer: called in the copying thread before each layer is copied (tests hold a layer
            back with it); CPU copies only.

    Raises:
        TypeError, PoolError, ValueError: as `copy_pages` does, naming the argument.
    """

    def __init__(
        self,
        src: KVPool,
        src_indices: torch.Tensor,
        dst: KVPool,
        dst_indices: torch.Tensor,
        *,
        before_layer: Callable[[int], None] | None = None,
    ) -> None:
        self._src, self._dst = src, dst
        self._src_pages, self._dst_pages = _validated_pages(src, src_indices, dst, dst_indices)
        self._before_layer = before_layer
        num_layers = src.layout.num_layers
        self._cuda = next((p.device for p in (src, dst) if p.device.type == "cuda"), None)
        self.readiness: CpuLayerReadiness | CudaLayerReadiness = (
            CudaLayerReadiness(num_layers) if self._cuda is not None else CpuLayerReadiness(num_layers)
        )
        self._started = False
        self._lock = threading.Lock()
        self._aborted = False
        self._working = False  # a thread is copying or enqueueing (under `_lock`)
        self._thread_done = threading.Event()
        self._last_event: torch.cuda.Event | None = None  # CUDA: recorded after everything this copy enqueued

    def abort(self) -> None:
        """Stop the copy at its next layer: a thread not started yet never copies, a running one stops
        before its next layer. `settled` then says when nothing writes into `dst` any more."""
        with self._lock:
            self._aborted = True

    @property
    def settled(self) -> bool:
        """Whether no thread and no kernel of this copy can still write into `dst` (never started, aborted
        before its thread began, or its thread has returned and, on CUDA, its last recorded event
        completed)."""
        with self._lock:
            if not self._started or (self._aborted and not self._working):
                return True
        if not self._thread_done.is_set():
            return False
        # CUDA: the event recorded after the last enqueue, not the last layer's: an enqueue that raised
        # part-way may have launched kernels after that layer's event.
        if self._last_event is not None:
            return bool(self._last_event.query())  # type: ignore[no-untyped-call]
        return True

    async def wait_settled(self) -> None:
        """Wait until `settled` (polls; a cancellation meanwhile is absorbed, then re-raised). Settled
        already: returns at once, with no turn of the loop (a landing load ends in the turn its copy does)."""
        if not self.settled:
            await uncancellable(self._poll_settled())

    async def _poll_settled(self) -> None:
        while not self.settled:  # noqa: ASYNC110 - polled: a thread or a CUDA event cannot wake the loop
            await asyncio.sleep(_POLL_INTERVAL_S)

    def _begin_work(self) -> bool:
        """Called first in the copying thread: whether to go on (False once aborted)."""
        with self._lock:
            if self._aborted:
                self._thread_done.set()
                return False
            self._working = True
            return True

    async def run(self, *, limiter: asyncio.Semaphore | None = None) -> None:
        """Copy every layer in order, marking each ready as it lands; return when all have.

        Raises:
            LoadBackFailed: when the copy failed (the readiness reports it to the model too).
        """
        if self._started:
            raise RuntimeError("run: a LayerwiseCopy runs once")
        self._started = True
        readiness = self.readiness
        if isinstance(readiness, CpuLayerReadiness):
            try:
                await self._in_thread(limiter, self._copy_cpu, readiness)
            except BaseException as exc:
                readiness.fail(exc)
                if isinstance(exc, Exception):
                    raise LoadBackFailed(f"layer-wise copy failed: {exc!r}") from exc
                raise
            if not readiness.is_ready(readiness.num_layers - 1):  # aborted before its thread began
                error = LoadBackFailed("layer-wise copy aborted before it began")
                readiness.fail(error)
                raise error
            return
        assert self._cuda is not None
        after = torch.cuda.current_stream(self._cuda)
        try:
            await self._in_thread(limiter, self._enqueue_cuda, readiness, after)
        except Exception as exc:  # the readiness already says so: its events stop short
            readiness.fail(exc)
            raise LoadBackFailed(f"layer-wise copy failed: {exc!r}") from exc
        if len(readiness.events) < readiness.num_layers:  # aborted before its thread began
            error = LoadBackFailed("layer-wise copy aborted before it began")
            readiness.fail(error)
            raise error
        await _wait_event(readiness.events[-1])

    async def _in_thread(
        self, limiter: asyncio.Semaphore | None, func: Callable[..., None], *args: object
    ) -> None:
        """`func(*args)` in a worker thread. A cancellation aborts the copy (it stops before its next
        layer) and propagates at once: the owner awaits `wait_settled` before `dst`'s pages go elsewhere."""
        try:
            if limiter is None:
                await asyncio.to_thread(func, *args)
                return
            async with limiter:
                await asyncio.to_thread(func, *args)
        except asyncio.CancelledError:
            self.abort()
            raise

    # ------------------------------------------------------------------ CPU

    def _copy_cpu(self, readiness: CpuLayerReadiness) -> None:
        """Copy layer by layer with numpy strided copies (single-threaded, GIL released; no OpenMP team
        spinning against the model's, see `transfer._copy_runs_in_memory`); stops early once aborted."""
        if not self._begin_work():
            return
        try:
            src, dst = _layer_bytes(self._src), _layer_bytes(self._dst)
            runs = _runs(self._src_pages, self._dst_pages)
            for layer in range(readiness.num_layers):
                if self._before_layer is not None:
                    self._before_layer(layer)
                if self._aborted:
                    raise LoadBackFailed(f"layer-wise copy aborted before layer {layer}")
                for s, d, k in runs:
                    np.copyto(dst[d : d + k, layer], src[s : s + k, layer])
                readiness.mark_ready(layer)
        finally:
            self._thread_done.set()

    # ------------------------------------------------------------------ CUDA

    def _enqueue_cuda(self, readiness: CudaLayerReadiness, after: torch.cuda.Stream) -> None:
        """Enqueue every layer's gather on a side stream (after `after`), one event per layer."""
        assert self._cuda is not None
        if not self._begin_work():
            readiness._enqueued.set()
            return
        host_is_src = self._src.device.type == "cpu"
        stream: torch.cuda.Stream | None = None
        try:
            stream = torch.cuda.Stream(device=self._cuda)  # type: ignore[no-untyped-call]
            stream.wait_stream(after)
            with torch.cuda.stream(stream):
                src_index = self._src_pages.pin_memory().to(self._cuda, non_blocking=True)
                dst_index = self._dst_pages.pin_memory().to(self._cuda, non_blocking=True)
                mapped = (
                    _mapped_host_view(self._src if host_is_src else self._dst, self._cuda)
                    if {self._src.device.type, self._dst.device.type} == {"cpu", "cuda"}
                    else None
                )
                for layer in range(readiness.num_layers):
                    if self._aborted:
                        raise LoadBackFailed(f"layer-wise copy aborted before layer {layer}")
                    self._enqueue_layer(layer, mapped, host_is_src, src_index, dst_index)
                    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                    event.record(stream)
                    readiness.events.append(event)
        finally:
            try:
                if stream is not None:  # whatever was launched on it, a failed enqueue's kernels included
                    last = torch.cuda.Event()  # type: ignore[no-untyped-call]
                    last.record(stream)
                    self._last_event = last
            finally:
                readiness._enqueued.set()
                self._thread_done.set()

    def _enqueue_layer(
        self,
        layer: int,
        mapped: torch.Tensor | None,
        host_is_src: bool,
        src_index: torch.Tensor,
        dst_index: torch.Tensor,
    ) -> None:
        src_layer = (mapped if mapped is not None and host_is_src else self._src.buffer).select(1, layer)
        dst_layer = (mapped if mapped is not None and not host_is_src else self._dst.buffer).select(1, layer)
        if mapped is not None or self._src.device == self._dst.device:
            dst_layer.index_copy_(0, dst_index, src_layer.index_select(0, src_index))
            return
        # No mapped view: gather the layer on the CPU side into pinned staging, one DMA, scatter there.
        if host_is_src:
            staging = src_layer.index_select(0, self._src_pages).pin_memory()
            dst_layer.index_copy_(0, dst_index, staging.to(self._cuda, non_blocking=True))
        else:
            gathered = src_layer.index_select(0, src_index).to("cpu")
            dst_layer.index_copy_(0, self._dst_pages, gathered)


def _layer_bytes(pool: KVPool) -> np.ndarray:
    """A CPU pool's buffer as bytes shaped ``(pages, layers, bytes per layer of a page)``."""
    flat = np.frombuffer(pool.byte_view(), dtype=np.uint8)
    layout = pool.layout
    return flat.reshape(-1, layout.num_layers, layout.page_nbytes // layout.num_layers)
