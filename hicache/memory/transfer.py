"""Page copies between pools: synchronous, and awaitable without blocking the event loop.

Indices are validated token indices of whole, aligned pages; the copy works on the page dimension of the
page-first buffers. Four cases:

* both pools on one CUDA device: one indexed gather (``index_select``) and one scatter (``index_copy_``);
* both pools on the CPU: one plain memory copy per run of pages consecutive on both sides, through the
  pools' byte views (see `_copy_runs_in_memory` for why not a torch op);
* between a CUDA device and host memory: the pages are cut into runs consecutive on the host side. A run
  consecutive on the device too is one direct ``copy_`` between contiguous slices; a run whose device
  pages are scattered goes through a device staging buffer (a gather or scatter kernel plus one
  ``copy_``), so scattered device pages do not cost one small copy each. Copies are ``non_blocking``
  when the host side is pinned. The host side is never staged, so an asynchronous D2H copy can never be
  scattered on the host before it has landed;
* two CUDA devices: one ``copy_`` per run consecutive on both sides.

Launching a copy costs a few microseconds, so a plan of more than `_INLINE_RUNS` operations is enqueued
from a worker thread: 32k launches on the event loop would stall it for a good part of a second.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import anyio
import anyio.lowlevel
import anyio.to_thread
import torch

from hicache.memory.pool import KVPool

__all__ = ["copy_pages", "copy_pages_async"]

_POLL_INTERVAL_S = 0.0002
"""How long `copy_pages_async` sleeps between `event.query()` polls of a CUDA copy."""
_INLINE_RUNS = 64
"""The most run copies `copy_pages_async` enqueues on the event loop itself (well under a millisecond)."""
_STAGE_BYTES = 64 << 20
"""The largest device staging buffer a copy of scattered device pages uses at once."""


def _check_compatible(src: KVPool, dst: KVPool) -> None:
    if not isinstance(src, KVPool):
        raise TypeError(f"src: expected a KVPool, got {type(src).__name__}")
    if not isinstance(dst, KVPool):
        raise TypeError(f"dst: expected a KVPool, got {type(dst).__name__}")
    if src.layout.page_shape != dst.layout.page_shape:
        raise ValueError(
            f"dst: page_shape {dst.layout.page_shape} differs from src page_shape {src.layout.page_shape}"
        )
    if src.layout.dtype != dst.layout.dtype:
        raise ValueError(f"dst: dtype {dst.layout.dtype} differs from src dtype {src.layout.dtype}")


def _validated_pages(
    src: KVPool, src_indices: torch.Tensor, dst: KVPool, dst_indices: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_compatible(src, dst)
    src_pages = src.page_ids(src_indices, name="src_indices")
    dst_pages = dst.page_ids(dst_indices, name="dst_indices")
    if src_pages.numel() != dst_pages.numel():
        raise ValueError(
            f"dst_indices: {dst_indices.numel()} tokens, but src_indices has {src_indices.numel()}"
        )
    return src_pages, dst_pages


def _runs(src_pages: torch.Tensor, dst_pages: torch.Tensor) -> list[tuple[int, int, int]]:
    """Split page pairs into ``(src_start, dst_start, length)`` runs consecutive on both sides."""
    n = src_pages.numel()
    if n == 0:
        return []
    breaks = ((src_pages[1:] - src_pages[:-1]) != 1) | ((dst_pages[1:] - dst_pages[:-1]) != 1)
    starts = [0, *(torch.nonzero(breaks).view(-1) + 1).tolist()]
    ends = [*starts[1:], n]
    s_list, d_list = src_pages.tolist(), dst_pages.tolist()
    return [(s_list[a], d_list[a], b - a) for a, b in zip(starts, ends, strict=True)]


@dataclass(frozen=True, slots=True)
class _Plan:
    """How pages move between pools on different devices.

    Attributes:
        direct: ``(src_start, dst_start, count)`` runs consecutive on both sides: one ``copy_`` each.
        staged: ``(host_start, first, count)`` runs consecutive on the host side only, ``first`` indexing
            `device_pages`: each is one gather (or scatter) kernel on the device plus one ``copy_``.
        device_pages: the device side's page ids, in transfer order (None when nothing is staged).
    """

    direct: list[tuple[int, int, int]]
    staged: list[tuple[int, int, int]] = field(default_factory=list)
    device_pages: torch.Tensor | None = None

    @property
    def operations(self) -> int:
        """Copies and kernels to enqueue."""
        return len(self.direct) + 2 * len(self.staged)


def _plan(src: KVPool, src_pages: torch.Tensor, dst: KVPool, dst_pages: torch.Tensor) -> _Plan:
    """Group the pages of a cross-device copy into as few operations as the two layouts allow.

    Between a CUDA pool and host memory, runs are cut where the host pages stop being consecutive: a run
    whose device pages are scattered goes through a device staging buffer (an indexed gather or scatter
    on the GPU) in one host copy, instead of one small copy per page. Staged runs are cut to
    `_STAGE_BYTES` so the staging buffer stays small.
    """
    kinds = {src.device.type, dst.device.type}
    if kinds != {"cpu", "cuda"}:
        return _Plan(_runs(src_pages, dst_pages))
    host_is_src = src.device.type == "cpu"
    host_pages, device_pages = (src_pages, dst_pages) if host_is_src else (dst_pages, src_pages)
    n = host_pages.numel()
    host_breaks = (host_pages[1:] - host_pages[:-1]) != 1
    starts = [0, *(torch.nonzero(host_breaks).view(-1) + 1).tolist()]
    ends = [*starts[1:], n]
    # Device breaks before position i, so a run [a, b) is consecutive on the device iff cum[b-1] == cum[a].
    device_cum = [0, *torch.cumsum((device_pages[1:] - device_pages[:-1]) != 1, 0).tolist()]
    hosts, devices = host_pages.tolist(), device_pages.tolist()
    stage = max(1, _STAGE_BYTES // src.layout.page_nbytes)
    direct: list[tuple[int, int, int]] = []
    staged: list[tuple[int, int, int]] = []
    for a, b in zip(starts, ends, strict=True):
        if device_cum[b - 1] == device_cum[a]:
            direct.append((hosts[a], devices[a], b - a) if host_is_src else (devices[a], hosts[a], b - a))
            continue
        for c in range(a, b, stage):
            staged.append((hosts[c], c, min(b, c + stage) - c))
    return _Plan(direct, staged, device_pages if staged else None)


def _copy_plan(src: KVPool, dst: KVPool, plan: _Plan) -> None:
    """Enqueue (on the current stream) or run a `_Plan`."""
    _copy_runs(src, dst, plan.direct)
    if not plan.staged:
        return
    assert plan.device_pages is not None
    device_pool = src if src.device.type == "cuda" else dst
    # Pinned and non-blocking: a pageable upload would wait for the stream, on the caller's thread.
    index = plan.device_pages.pin_memory().to(device_pool.device, non_blocking=True)
    # A staging buffer freed here is reused only by later work on this same stream, so it is never
    # overwritten while a copy still reads it.
    if device_pool is src:  # device -> host: gather on the GPU, one copy per host run
        for host_start, first, count in plan.staged:
            staging = src.buffer.index_select(0, index[first : first + count])
            dst.buffer[host_start : host_start + count].copy_(staging, non_blocking=True)
    else:  # host -> device: one copy per host run, scatter on the GPU
        for host_start, first, count in plan.staged:
            staging = torch.empty_like(dst.buffer[:count])
            staging.copy_(src.buffer[host_start : host_start + count], non_blocking=True)
            dst.buffer.index_copy_(0, index[first : first + count], staging)


def _copy_page_ids(src: KVPool, src_pages: torch.Tensor, dst: KVPool, dst_pages: torch.Tensor) -> None:
    """Copy validated pages; enqueues on the current CUDA stream when a side is on a CUDA device."""
    if src_pages.numel() == 0:
        return
    if src.device != dst.device:
        _copy_plan(src, dst, _plan(src, src_pages, dst, dst_pages))
        return
    if src.device.type == "cpu":
        _copy_runs_in_memory(src, dst, _runs(src_pages, dst_pages))
        return
    sp = src_pages.to(src.device)
    dp = dst_pages.to(dst.device)
    dst.buffer.index_copy_(0, dp, src.buffer.index_select(0, sp))


def _copy_runs_in_memory(src: KVPool, dst: KVPool, runs: list[tuple[int, int, int]]) -> None:
    """Two CPU pools: one plain `memmove` per run, with the GIL released.

    Not a torch op: a torch copy of a page of 64k+ elements is an OpenMP parallel region, and one run
    from a worker thread starts a second thread team that spins against the first for the cores
    (measured on 2 cores: 128 KiB pages at 13 GB/s from the main thread fell to 2-3 GB/s on both
    threads once a copy had run in a worker thread). Not a memoryview assignment either: that holds the
    GIL for the whole copy, and the event loop stalled 10-30 ms behind it (`bench/bench_transfer.py`).
    `ctypes.memmove` releases the GIL; the page ids were validated, and both buffers stay referenced.
    """
    src_buf, dst_buf = src.buffer, dst.buffer
    src_base, dst_base = src_buf.data_ptr(), dst_buf.data_ptr()
    size = src.layout.page_nbytes
    for s, d, k in runs:
        ctypes.memmove(dst_base + d * size, src_base + s * size, k * size)


def _copy_runs(src: KVPool, dst: KVPool, runs: list[tuple[int, int, int]]) -> None:
    """One `copy_` per run; non-blocking between a CUDA device and pinned host memory."""
    src_buf, dst_buf = src.buffer, dst.buffer
    host_pinned = (src.device.type == "cpu" and src.pinned) or (dst.device.type == "cpu" and dst.pinned)
    non_blocking = host_pinned and "cuda" in (src.device.type, dst.device.type)
    for s, d, k in runs:
        dst_buf[d : d + k].copy_(src_buf[s : s + k], non_blocking=non_blocking)


def _enqueue_on_side_stream(
    src: KVPool,
    dst: KVPool,
    plan: _Plan,
    device: torch.device,
    after: torch.cuda.Stream,
) -> torch.cuda.Event:
    """Enqueue a plan on a new side stream that first waits for `after`; return its end event.

    Safe to call from a worker thread: the side stream is made current only inside this call, and `after`
    (the caller's current stream, captured on its own thread) orders the copy after the caller's work.
    """
    stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
    stream.wait_stream(after)
    with torch.cuda.stream(stream):
        _copy_plan(src, dst, plan)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(stream)
    return event


def _copy_and_wait(src: KVPool, src_pages: torch.Tensor, dst: KVPool, dst_pages: torch.Tensor) -> None:
    _copy_page_ids(src, src_pages, dst, dst_pages)
    cuda = next((p.device for p in (src, dst) if p.device.type == "cuda"), None)
    if cuda is not None:
        torch.cuda.current_stream(cuda).synchronize()


def copy_pages(src: KVPool, src_indices: torch.Tensor, dst: KVPool, dst_indices: torch.Tensor) -> None:
    """Copy whole pages from `src` to `dst` and return when the copy is complete.

    Args:
        src: the pool read from.
        src_indices: token indices of whole, aligned pages of `src`.
        dst: the pool written to; must have the same `page_shape` and `dtype` as `src`.
        dst_indices: token indices of whole, aligned pages of `dst`, as many as `src_indices`.

    Raises:
        TypeError: when an index tensor is not a 1-D int64 CPU tensor, or a pool is not a `KVPool`.
        PoolError: when indices are misaligned or foreign.
        ValueError: when the layouts differ or the index counts differ.
    """
    src_pages, dst_pages = _validated_pages(src, src_indices, dst, dst_indices)
    _copy_and_wait(src, src_pages, dst, dst_pages)


async def copy_pages_async(
    src: KVPool,
    src_indices: torch.Tensor,
    dst: KVPool,
    dst_indices: torch.Tensor,
    *,
    limiter: anyio.CapacityLimiter | None = None,
) -> None:
    """Copy whole pages from `src` to `dst` without blocking the event loop.

    With a CUDA side and pinned (or no) host memory, the copy is enqueued on a side stream that first
    waits for the current stream, an event is recorded, and completion is awaited by polling
    `event.query()`. Otherwise (CPU pools, or pageable host memory whose copies would block) the copy runs
    in a worker thread through `anyio.to_thread.run_sync`.

    Cancellation never abandons a copy in flight: when the awaiting task is cancelled, this coroutine
    still waits for the worker thread or the CUDA event before re-raising the cancellation, so the caller
    may free either buffer as soon as it regains control.

    Args:
        src: the pool read from.
        src_indices: token indices of whole, aligned pages of `src`.
        dst: the pool written to; must have the same `page_shape` and `dtype` as `src`.
        dst_indices: token indices of whole, aligned pages of `dst`, as many as `src_indices`.
        limiter: bounds the worker threads used for thread copies (anyio's default limiter otherwise).

    Raises:
        TypeError: when an index tensor is not a 1-D int64 CPU tensor, or a pool is not a `KVPool`.
        PoolError: when indices are misaligned or foreign.
        ValueError: when the layouts differ or the index counts differ.
    """
    src_pages, dst_pages = _validated_pages(src, src_indices, dst, dst_indices)
    if src_pages.numel() == 0:
        return
    cuda = next((p.device for p in (src, dst) if p.device.type == "cuda"), None)
    pageable_host = any(p.device.type == "cpu" and not p.pinned for p in (src, dst))
    if cuda is None or pageable_host:
        # run_sync waits for the thread even when this task is cancelled (abandon_on_cancel=False).
        await anyio.to_thread.run_sync(_copy_and_wait, src, src_pages, dst, dst_pages, limiter=limiter)
        # The copy is complete; a cancellation that arrived meanwhile is raised here rather than later.
        await anyio.lowlevel.checkpoint_if_cancelled()
        return
    plan = _plan(src, src_pages, dst, dst_pages) if src.device != dst.device else _Plan([])
    if src.device == dst.device:  # one CUDA device: a gather and a scatter, enqueued inline
        stream = torch.cuda.Stream(device=cuda)  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream(cuda))
        with torch.cuda.stream(stream):
            _copy_page_ids(src, src_pages, dst, dst_pages)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
        await _wait_event_safely(event)
        return
    after = torch.cuda.current_stream(cuda)
    if plan.operations <= _INLINE_RUNS:
        event = _enqueue_on_side_stream(src, dst, plan, cuda, after)
    else:
        # Waits for the thread even when cancelled: once it returns, every copy is enqueued and the
        # event below covers them all.
        with anyio.CancelScope(shield=True):
            event = await anyio.to_thread.run_sync(
                _enqueue_on_side_stream, src, dst, plan, cuda, after, limiter=limiter
            )
    await _wait_event_safely(event)


async def _wait_event_safely(event: torch.cuda.Event) -> None:
    """Wait for a copy's event; if cancelled meanwhile, still wait for it before re-raising, so no DMA is
    still writing when the caller frees a buffer."""
    try:
        await _wait_event(event)
    except BaseException:
        with anyio.CancelScope(shield=True):
            await _wait_event(event)
        raise
    await anyio.lowlevel.checkpoint_if_cancelled()


async def _wait_event(event: torch.cuda.Event) -> None:
    """Poll a CUDA event: `event.synchronize()` would block the event loop, and CUDA offers no callback."""
    while True:
        if event.query():  # type: ignore[no-untyped-call]
            return
        await anyio.sleep(_POLL_INTERVAL_S)
