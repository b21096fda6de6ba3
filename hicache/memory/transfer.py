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

Pages scattered on both sides of a GPU <-> pinned host copy would be one small DMA each (launch-bound at
~10 GB/s on an H200 for 128 KiB pages). Where the platform maps pinned host memory into the device's
address space (unified addressing, checked once per device), such a copy runs instead as gather and
scatter kernels that read or write the host pool directly through a mapped view (`_mapped_host_view`).

Launching a copy costs a few microseconds, so a plan of more than `_INLINE_RUNS` operations is enqueued
from a worker thread: 32k launches on the event loop would stall it for a good part of a second.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

from hicache.memory.pool import KVPool
from storage_backends.cancellation import run_in_thread, uncancellable

__all__ = ["copy_pages", "copy_pages_async"]

logger = logging.getLogger(__name__)

_POLL_INTERVAL_S = 0.0002
"""How long `copy_pages_async` sleeps between `event.query()` polls of a CUDA copy."""
_INLINE_RUNS = 64
"""The most run copies `copy_pages_async` enqueues on the event loop itself (well under a millisecond)."""
_INLINE_CPU_BYTES = 256 << 10
"""The largest copy between two CPU pools `copy_pages_async` runs on the event loop itself (a `memmove` of
~10-30 us): a worker thread's round trip (executor queue, wake-up, the loop's self-pipe) costs the loop
more than that, and the write-through soak made one or two per request (`bench/bench_faults.py`)."""
_STAGE_BYTES = 64 << 20
"""The largest device staging buffer a copy of scattered device pages uses at once."""
_MAPPED_MIN_OPERATIONS = 64
_MAPPED_RUN_PAGES = 4
_MAPPED_MAX_PAGE_BYTES = 512 << 10
"""A cross-device plan goes through the host pool's mapped view when it would take more than
`_MAPPED_MIN_OPERATIONS` copies averaging fewer than `_MAPPED_RUN_PAGES` pages each, of pages up to
`_MAPPED_MAX_PAGE_BYTES`. Measured on an H200 (4 GiB, pages scattered on both sides): 128 KiB pages
0.17-0.23 of the link as copies, 0.70-0.71 mapped; 2 MiB pages 0.89 as copies, 0.83-0.84 mapped."""


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
    """Split page pairs into ``(src_start, dst_start, length)`` runs consecutive on both sides.

    A loop over the page lists: the eight torch ops it replaced cost ~60-70 us for a copy of a few pages
    (1-5 us this way, up to 32 pages), on the loop since small CPU copies run there (`_INLINE_CPU_BYTES`),
    and were no faster for 5,000 pages."""
    s, d = src_pages.tolist(), dst_pages.tolist()
    n = len(s)
    if n == 0:
        return []
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, n):
        if s[i] != s[i - 1] + 1 or d[i] != d[i - 1] + 1:
            runs.append((s[start], d[start], i - start))
            start = i
    runs.append((s[start], d[start], n - start))
    return runs


@dataclass(frozen=True, slots=True)
class _Plan:
    """How pages move between pools on different devices.

    Attributes:
        direct: ``(src_start, dst_start, count)`` runs consecutive on both sides: one ``copy_`` each.
        staged: ``(host_start, first, count)`` runs consecutive on the host side only, ``first`` indexing
            `device_pages`: each is one gather (or scatter) kernel on the device plus one ``copy_``.
        device_pages: the device side's page ids, in transfer order (None when not needed).
        host_pages: the host side's page ids, in transfer order, when the plan is `mapped`.
        mapped: pages scattered on both sides: gather and scatter kernels read or write the pinned host
            pool directly through its mapped view (`_mapped_host_view`), no per-page copy.
    """

    direct: list[tuple[int, int, int]]
    staged: list[tuple[int, int, int]] = field(default_factory=list)
    device_pages: torch.Tensor | None = None
    host_pages: torch.Tensor | None = None
    mapped: bool = False
    chunk_pages: int = 1

    @property
    def operations(self) -> int:
        """Copies and kernels to enqueue."""
        if self.mapped:
            assert self.host_pages is not None
            return 2 * -(-int(self.host_pages.numel()) // self.chunk_pages)
        return len(self.direct) + 2 * len(self.staged)


class _CudaPointer:
    """A raw device-visible address, offered to `torch.as_tensor` through `__cuda_array_interface__`."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
        }


_mapped_views: weakref.WeakKeyDictionary[KVPool, torch.Tensor | None] = weakref.WeakKeyDictionary()
_mapping_works: dict[torch.device, bool] = {}


def _map_pinned(buf: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CUDA tensor aliasing the pinned host tensor `buf` (same address, same dtype and shape)."""
    raw = torch.as_tensor(_CudaPointer(buf.data_ptr(), buf.numel() * buf.element_size()), device=device)
    return raw.view(buf.dtype).view(buf.shape)


def _check_mapping(device: torch.device) -> bool:
    """Whether pinned host memory read through a mapped view on `device` holds what the host wrote.

    Checked once per device on a scratch buffer of its own (never a pool's pages, which copies may be
    using), on a side stream so that only this check is waited for.
    """
    if device not in _mapping_works:
        works = False
        try:
            probe = torch.randint(0, 256, (4096,), dtype=torch.uint8).pin_memory()
            with torch.cuda.stream(torch.cuda.Stream(device=device)):  # type: ignore[no-untyped-call]
                seen = _map_pinned(probe, device).clone().cpu()
            works = torch.equal(seen, probe)
            if not works:
                logger.warning("pinned memory mapped on %s reads other bytes: not used", device)
        except (RuntimeError, TypeError, ValueError) as exc:
            logger.info(
                "pinned memory cannot be mapped on %s (%s): scattered pages copy one by one", device, exc
            )
        _mapping_works[device] = works
    return _mapping_works[device]


def _mapped_host_view(host: KVPool, device: torch.device) -> torch.Tensor | None:
    """A CUDA tensor over the pinned host pool's own memory, or None where the platform does not allow it.

    With unified addressing, pinned host memory is mapped into every device's address space at its host
    address, so a kernel can gather pages from it or scatter pages into it over the host link with no
    per-page copy (what SGLang's transfer kernels do). Made once per pool, once `_check_mapping` proved
    the mechanism on this device.
    """
    if host in _mapped_views:
        return _mapped_views[host]
    view: torch.Tensor | None = None
    if host.pinned and _check_mapping(device):
        try:
            view = _map_pinned(host.buffer, device)
        except (RuntimeError, TypeError, ValueError) as exc:
            logger.info("pool %r: no mapped device view (%s)", host.name, exc)
    _mapped_views[host] = view
    return view


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
    operations = len(direct) + 2 * len(staged)
    if (
        src.layout.page_nbytes <= _MAPPED_MAX_PAGE_BYTES
        and operations > _MAPPED_MIN_OPERATIONS
        and operations * _MAPPED_RUN_PAGES > n
    ):
        # Mostly single pages on both sides: kernels through the host pool's mapped view, if it has one.
        host_pool = src if host_is_src else dst
        device = (dst if host_is_src else src).device
        if _mapped_host_view(host_pool, device) is not None:
            return _Plan([], device_pages=device_pages, host_pages=host_pages, mapped=True, chunk_pages=stage)
    return _Plan(direct, staged, device_pages if staged else None)


def _upload_index(pages: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Page ids on `device`, pinned and non-blocking: a pageable upload would wait for the stream, on the
    caller's thread."""
    return pages.pin_memory().to(device, non_blocking=True)


def _copy_plan(src: KVPool, dst: KVPool, plan: _Plan) -> None:
    """Enqueue (on the current stream) or run a `_Plan`."""
    _copy_runs(src, dst, plan.direct)
    if not plan.staged and not plan.mapped:
        return
    assert plan.device_pages is not None
    device_pool = src if src.device.type == "cuda" else dst
    index = _upload_index(plan.device_pages, device_pool.device)
    if plan.mapped:
        _copy_mapped(src, dst, plan, device_pool, index)
        return
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


def _copy_mapped(
    src: KVPool, dst: KVPool, plan: _Plan, device_pool: KVPool, device_index: torch.Tensor
) -> None:
    """Enqueue a mapped plan: per chunk, one gather kernel and one scatter kernel, one side of them
    reading or writing the pinned host pool through its mapped view."""
    assert plan.host_pages is not None
    host_pool = dst if device_pool is src else src
    host_pool.buffer  # noqa: B018 - raises CacheClosed once the pool is closed: the view would dangle
    view = _mapped_views.get(host_pool)
    assert view is not None
    host_index = _upload_index(plan.host_pages, device_pool.device)
    n, step = int(host_index.numel()), plan.chunk_pages
    for c in range(0, n, step):
        hi, di = host_index[c : c + step], device_index[c : c + step]
        if device_pool is src:  # device -> host: gather on the device, scatter into host memory
            view.index_copy_(0, hi, src.buffer.index_select(0, di))
        else:  # host -> device: gather from host memory, scatter on the device
            dst.buffer.index_copy_(0, di, view.index_select(0, hi))


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
    dst.buffer.index_copy_(
        0,
        _upload_index(dst_pages, dst.device),
        src.buffer.index_select(0, _upload_index(src_pages, src.device)),
    )


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
    enqueue: Callable[[], None], device: torch.device, after: torch.cuda.Stream
) -> torch.cuda.Event:
    """Run `enqueue` (which enqueues copies on the current stream) with a new side stream current, that
    side stream first waiting for `after`; return an event recorded after the copies.

    Safe to call from a worker thread: the side stream is made current only inside this call, and `after`
    (the caller's current stream, captured on its own thread) orders the copy after the caller's work.
    """
    stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
    stream.wait_stream(after)
    with torch.cuda.stream(stream):
        enqueue()
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
    limiter: asyncio.Semaphore | None = None,
) -> None:
    """Copy whole pages from `src` to `dst` without blocking the event loop.

    With a CUDA side and pinned (or no) host memory, the copy is enqueued on a side stream that first
    waits for the current stream, an event is recorded, and completion is awaited by polling
    `event.query()`. Between two CPU pools, a copy of at most `_INLINE_CPU_BYTES` runs here, on the loop
    (cheaper than a thread's round trip). Otherwise (larger CPU copies, or pageable host memory whose
    copies would block) the copy runs in a worker thread (`storage_backends.cancellation.run_in_thread`).

    Cancellation never abandons a copy in flight: when the awaiting task is cancelled, this coroutine
    still waits for the worker thread or the CUDA event before re-raising the cancellation, so the caller
    may free either buffer as soon as it regains control.

    Args:
        src: the pool read from.
        src_indices: token indices of whole, aligned pages of `src`.
        dst: the pool written to; must have the same `page_shape` and `dtype` as `src`.
        dst_indices: token indices of whole, aligned pages of `dst`, as many as `src_indices`.
        limiter: bounds how many thread copies run at once (unbounded beyond the executor's own threads
            otherwise).

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
    if cuda is None and src_pages.numel() * src.layout.page_nbytes <= _INLINE_CPU_BYTES:
        _copy_runs_in_memory(src, dst, _runs(src_pages, dst_pages))  # nothing left to wait for
        return
    if cuda is None or pageable_host:
        # Waits for the thread even when this task is cancelled, then re-raises the cancellation.
        await run_in_thread(_copy_and_wait, src, src_pages, dst, dst_pages, limiter=limiter)
        return
    after = torch.cuda.current_stream(cuda)
    if src.device == dst.device:  # one CUDA device: a gather and a scatter
        enqueue, operations = partial(_copy_page_ids, src, src_pages, dst, dst_pages), 2
    else:
        plan = _plan(src, src_pages, dst, dst_pages)
        enqueue, operations = partial(_copy_plan, src, dst, plan), plan.operations
    if operations <= _INLINE_RUNS:
        event = _enqueue_on_side_stream(enqueue, cuda, after)
    else:
        # The enqueueing thread and the copies it enqueued are waited for as one: a cancellation meanwhile
        # is re-raised once both are done.
        await uncancellable(_enqueue_and_wait(enqueue, cuda, after, limiter))
        return
    await uncancellable(_wait_event(event))  # no DMA still writes when the caller frees a buffer


async def _enqueue_and_wait(
    enqueue: Callable[[], None],
    cuda: torch.device,
    after: torch.cuda.Stream,
    limiter: asyncio.Semaphore | None,
) -> None:
    """Enqueue the copies from a worker thread, then wait for them to land."""
    event = await run_in_thread(_enqueue_on_side_stream, enqueue, cuda, after, limiter=limiter)
    await _wait_event(event)


async def _wait_event(event: torch.cuda.Event) -> None:
    """Poll a CUDA event: `event.synchronize()` would block the event loop, and CUDA offers no callback."""
    while True:
        if event.query():  # type: ignore[no-untyped-call]
            return
        await asyncio.sleep(_POLL_INTERVAL_S)
