"""Page copies between pools, synchronous and awaitable, including cancellation of an in-flight copy."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import anyio
import anyio.to_thread
import pytest
import torch

from hicache.errors import PoolError
from hicache.memory import KVLayout, KVPool, copy_pages, copy_pages_async, make_device_pool
from hicache.memory import transfer as transfer_module

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16, page_size=4)
P = LAYOUT.page_size


_open_pools: list[KVPool] = []


def opened(p: KVPool) -> KVPool:
    """Register `p` to be closed after the test."""
    _open_pools.append(p)
    return p


@pytest.fixture(autouse=True)
def close_pools() -> Iterator[None]:
    """Close every pool the test opened: an unclosed pool warns, and warnings are errors."""
    yield
    while _open_pools:
        _open_pools.pop().close()


def pool(num_pages: int, name: str, layout: KVLayout = LAYOUT) -> KVPool:
    return opened(KVPool(layout, num_pages, pin_memory=False, name=name))


def fill_random(p: KVPool, indices: torch.Tensor, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(p.layout.tokens_shape(indices.numel()), generator=g).to(p.layout.dtype)
    p.write_tokens(indices, kv)
    return kv


def alloc(p: KVPool, num_tokens: int) -> torch.Tensor:
    idx = p.alloc(num_tokens)
    assert idx is not None
    return idx


def scattered_pages(p: KVPool, pages: list[int]) -> torch.Tensor:
    """Token indices of the given pages, in the given order (not one consecutive run)."""
    return p.allocator.pages_to_tokens(torch.tensor(pages, dtype=torch.int64))


def test_copy_pages_round_trip_is_bitwise() -> None:
    src, dst = pool(6, "src"), pool(6, "dst")
    s_idx, d_idx = alloc(src, 3 * P), alloc(dst, 3 * P)
    kv = fill_random(src, s_idx)
    copy_pages(src, s_idx, dst, d_idx)
    assert torch.equal(dst.read_tokens(d_idx).view(torch.int16), kv.view(torch.int16))
    back = pool(6, "back")
    b_idx = alloc(back, 3 * P)
    copy_pages(dst, d_idx, back, b_idx)
    assert torch.equal(back.buffer[:3], src.buffer[:3])


def test_copy_pages_maps_scattered_pages_in_order() -> None:
    src, dst = pool(6, "src"), pool(6, "dst")
    s_idx = scattered_pages(src, [4, 0, 2])
    d_idx = scattered_pages(dst, [1, 5, 3])
    fill_random(src, s_idx)
    copy_pages(src, s_idx, dst, d_idx)
    for s, d in [(4, 1), (0, 5), (2, 3)]:
        assert torch.equal(dst.buffer[d], src.buffer[s])
    assert bool((dst.buffer[[0, 2, 4]] == 0).all())


def test_copy_pages_runs_split_where_either_side_breaks() -> None:
    runs = transfer_module._runs(torch.tensor([0, 1, 2, 7, 8]), torch.tensor([3, 4, 9, 10, 11]))
    assert runs == [(0, 3, 2), (2, 9, 1), (7, 10, 2)]


def test_copy_pages_rejects_mismatched_layouts_and_counts() -> None:
    src = pool(4, "src")
    other = pool(4, "other", KVLayout(2, 2, 8, torch.bfloat16, page_size=8))
    other_dtype = pool(4, "f16", KVLayout(2, 2, 8, torch.float16, page_size=4))
    idx = torch.arange(P, dtype=torch.int64)
    with pytest.raises(ValueError, match="page_shape"):
        copy_pages(src, idx, other, torch.arange(8, dtype=torch.int64))
    with pytest.raises(ValueError, match="dtype"):
        copy_pages(src, idx, other_dtype, idx)
    with pytest.raises(ValueError, match="dst_indices"):
        copy_pages(src, idx, pool(4, "dst"), torch.arange(2 * P, dtype=torch.int64))
    with pytest.raises(PoolError, match="src_indices"):
        copy_pages(src, idx + 1, pool(4, "dst"), idx)
    with pytest.raises(TypeError, match="dst_indices"):
        copy_pages(src, idx, pool(4, "dst"), idx.to(torch.int32))


async def test_copy_pages_async_round_trip_is_bitwise() -> None:
    src, dst = pool(6, "src"), pool(6, "dst")
    s_idx = scattered_pages(src, [5, 1])
    d_idx = alloc(dst, 2 * P)
    kv = fill_random(src, s_idx, seed=3)
    await copy_pages_async(src, s_idx, dst, d_idx)
    assert torch.equal(dst.read_tokens(d_idx).view(torch.int16), kv.view(torch.int16))


async def test_copy_pages_async_validates_before_starting() -> None:
    src, dst = pool(2, "src"), pool(2, "dst")
    with pytest.raises(PoolError, match="dst_indices"):
        await copy_pages_async(src, torch.arange(P), dst, torch.arange(1, P + 1))


@pytest.mark.parametrize("how", ["asyncio.timeout", "task.cancel"])
async def test_a_copy_cancelled_by_asyncio_waits_for_its_worker_thread(
    monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """A cancelled copy must not return while its thread still writes into a buffer the caller may free.
    anyio's `run_sync` held off anyio's cancellation only: under asyncio's own the copy used to return at
    once, its thread still writing."""
    started, release = threading.Event(), threading.Event()
    real_copy = transfer_module._copy_page_ids

    def gated_copy(src: KVPool, sp: torch.Tensor, dst: KVPool, dp: torch.Tensor) -> None:
        started.set()
        release.wait(timeout=30)
        real_copy(src, sp, dst, dp)

    monkeypatch.setattr(transfer_module, "_copy_page_ids", gated_copy)
    monkeypatch.setattr(transfer_module, "_INLINE_CPU_BYTES", 0)  # a thread copy, however small
    src, dst = pool(4, "src"), pool(4, "dst")
    s_idx, d_idx = alloc(src, 4 * P), alloc(dst, 4 * P)
    kv = fill_random(src, s_idx, seed=7)
    loop = asyncio.get_running_loop()
    deadline = asyncio.timeout(None)

    async def run_copy() -> None:
        async with deadline:
            await copy_pages_async(src, s_idx, dst, d_idx)

    task = loop.create_task(run_copy())
    try:
        await anyio.to_thread.run_sync(started.wait)
        if how == "asyncio.timeout":
            deadline.reschedule(loop.time())
        else:
            task.cancel()
        await anyio.wait_all_tasks_blocked()
        assert not task.done(), "the cancelled copy returned while its worker was still running"
    finally:
        release.set()
    (done,) = await asyncio.gather(task, return_exceptions=True)
    assert isinstance(done, TimeoutError if how == "asyncio.timeout" else asyncio.CancelledError)
    assert torch.equal(dst.read_tokens(d_idx).view(torch.int16), kv.view(torch.int16))


async def test_a_small_cpu_copy_runs_on_the_loop_and_a_large_one_in_a_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A copy between CPU pools of at most `_INLINE_CPU_BYTES` is a `memmove` of microseconds: it used to
    take a worker thread's round trip, which cost the event loop more than the copy (one or two per
    request in the write-through soak of `bench/bench_faults.py`). A larger one still runs in a thread."""
    hops: list[object] = []
    real_run_in_thread = transfer_module.run_in_thread

    async def counted(func: Any, /, *args: Any, limiter: asyncio.Semaphore | None = None) -> Any:
        hops.append(func)
        return await real_run_in_thread(func, *args, limiter=limiter)

    monkeypatch.setattr(transfer_module, "run_in_thread", counted)
    src, dst = pool(8, "src"), pool(8, "dst")
    s_idx, d_idx = scattered_pages(src, [5, 0, 3, 1]), scattered_pages(dst, [2, 7, 4, 6])
    kv = fill_random(src, s_idx, seed=11)
    monkeypatch.setattr(transfer_module, "_INLINE_CPU_BYTES", 4 * LAYOUT.page_nbytes)
    await copy_pages_async(src, s_idx, dst, d_idx)
    assert hops == []
    assert torch.equal(dst.read_tokens(d_idx).view(torch.int16), kv.view(torch.int16))
    monkeypatch.setattr(transfer_module, "_INLINE_CPU_BYTES", 4 * LAYOUT.page_nbytes - 1)
    await copy_pages_async(src, s_idx, dst, d_idx)
    assert len(hops) == 1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_copy_pages_async_between_device_and_pinned_host() -> None:
    device = opened(make_device_pool(LAYOUT, 8))
    host = opened(KVPool(LAYOUT, 8, pin_memory=True, name="host"))
    assert host.pinned
    h_idx = scattered_pages(host, [6, 2, 3, 0])
    kv = fill_random(host, h_idx, seed=11)
    d_idx = scattered_pages(device, [1, 2, 7, 4])
    await copy_pages_async(host, h_idx, device, d_idx)  # H2D
    assert torch.equal(device.read_tokens(d_idx).cpu().view(torch.int16), kv.view(torch.int16))
    back = opened(KVPool(LAYOUT, 8, pin_memory=True, name="back"))
    b_idx = scattered_pages(back, [3, 4, 0, 5])
    await copy_pages_async(device, d_idx, back, b_idx)  # D2H
    assert torch.equal(back.read_tokens(b_idx).view(torch.int16), kv.view(torch.int16))
    other = opened(make_device_pool(LAYOUT, 8))
    o_idx = alloc(other, 4 * P)
    await copy_pages_async(device, d_idx, other, o_idx)  # D2D
    copy_pages(other, o_idx, back, b_idx)
    assert torch.equal(back.read_tokens(b_idx).view(torch.int16), kv.view(torch.int16))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_cancelled_cuda_copy_completes_before_returning() -> None:
    layout = KVLayout(num_layers=8, num_kv_heads=8, head_dim=128, dtype=torch.float16, page_size=64)
    device = opened(make_device_pool(layout, 16))
    host = opened(KVPool(layout, 16, pin_memory=True, name="host"))
    d_idx, h_idx = alloc(device, 16 * 64), alloc(host, 16 * 64)
    device.buffer.fill_(3.0)
    with anyio.CancelScope() as scope:
        scope.cancel()
        await copy_pages_async(device, d_idx, host, h_idx)
    assert scope.cancelled_caught
    assert bool((host.buffer == 3.0).all())


BIG_PAGES = KVLayout(num_layers=2, num_kv_heads=2, head_dim=256, dtype=torch.bfloat16, page_size=4)
"""16 KiB pages, beside the 512-byte pages of LAYOUT."""


@pytest.mark.parametrize("layout", [LAYOUT, BIG_PAGES], ids=["512B-pages", "16KiB-pages"])
async def test_scattered_cpu_copies_are_bitwise_on_both_paths(layout: KVLayout) -> None:
    """Scattered pages between CPU pools, small and larger pages, async and sync: bitwise."""
    src, dst = pool(64, "src", layout), pool(64, "dst", layout)
    order = torch.randperm(64, generator=torch.Generator().manual_seed(3)).tolist()
    s_idx = scattered_pages(src, order[:40])
    d_idx = scattered_pages(dst, order[24:])
    kv = fill_random(src, s_idx, seed=5)
    await copy_pages_async(src, s_idx, dst, d_idx)
    assert torch.equal(dst.read_tokens(d_idx).view(torch.int16), kv.view(torch.int16))
    copy_pages(dst, d_idx[: 8 * P], src, s_idx[-8 * P :])
    assert torch.equal(
        src.read_tokens(s_idx[-8 * P :]).view(torch.int16), kv[:, :, : 8 * P].view(torch.int16)
    )


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_many_scattered_cuda_runs_are_enqueued_off_the_loop_after_the_callers_stream() -> None:
    """More runs than `_INLINE_RUNS`: enqueued from a worker thread, still ordered after the caller's
    current stream (work the caller queued there lands before the copy reads), bitwise both ways."""
    pages = 4 * transfer_module._INLINE_RUNS
    device = opened(make_device_pool(LAYOUT, pages))
    host = opened(KVPool(LAYOUT, pages, pin_memory=True, name="host"))
    order = torch.randperm(pages, generator=torch.Generator().manual_seed(9)).tolist()
    h_idx = scattered_pages(host, order)
    d_idx = scattered_pages(device, list(range(pages))[::-1])
    kv = fill_random(host, h_idx, seed=13)
    await copy_pages_async(host, h_idx, device, d_idx)
    assert torch.equal(device.read_tokens(d_idx).cpu().view(torch.int16), kv.view(torch.int16))
    caller = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    with torch.cuda.stream(caller):
        torch.cuda._sleep(50_000_000)  # type: ignore[attr-defined]  # keep the caller's stream busy
        device.buffer.fill_(7.0)
        await copy_pages_async(device, d_idx, host, h_idx)
    assert bool((host.read_tokens(h_idx) == 7.0).all())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_a_cancelled_threaded_cuda_copy_completes_before_returning() -> None:
    pages = 4 * transfer_module._INLINE_RUNS
    device = opened(make_device_pool(LAYOUT, pages))
    host = opened(KVPool(LAYOUT, pages, pin_memory=True, name="host"))
    d_idx = scattered_pages(device, list(range(pages))[::-1])
    h_idx = alloc(host, pages * P)
    device.buffer.fill_(3.0)
    with anyio.CancelScope() as scope:
        scope.cancel()
        await copy_pages_async(device, d_idx, host, h_idx)
    assert scope.cancelled_caught
    assert bool((host.buffer == 3.0).all())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_a_threaded_cuda_copy_cancelled_by_asyncio_while_enqueueing_completes_before_returning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`Task.cancel` while the enqueueing thread runs: anyio's shield there did not hold it off, and the
    copy returned before its copies were enqueued, let alone landed."""
    started, release = threading.Event(), threading.Event()
    real_enqueue = transfer_module._enqueue_on_side_stream

    def gated_enqueue(*args: Any) -> torch.cuda.Event:
        started.set()
        release.wait(timeout=30)
        return real_enqueue(*args)

    monkeypatch.setattr(transfer_module, "_enqueue_on_side_stream", gated_enqueue)
    pages = 4 * transfer_module._INLINE_RUNS
    device = opened(make_device_pool(LAYOUT, pages))
    host = opened(KVPool(LAYOUT, pages, pin_memory=True, name="host"))
    d_idx = scattered_pages(device, list(range(pages))[::-1])
    h_idx = alloc(host, pages * P)
    device.buffer.fill_(3.0)
    task = asyncio.get_running_loop().create_task(copy_pages_async(device, d_idx, host, h_idx))
    try:
        await anyio.to_thread.run_sync(started.wait)
        task.cancel()
        await anyio.wait_all_tasks_blocked()
        assert not task.done(), "the cancelled copy returned while its copies were being enqueued"
    finally:
        release.set()
    (done,) = await asyncio.gather(task, return_exceptions=True)
    assert isinstance(done, asyncio.CancelledError)
    assert bool((host.buffer == 3.0).all())


class _FakePool:
    """What `_plan` reads of a pool: its device and page size."""

    pinned = False  # no mapped view: plans stay copies

    def __init__(self, device: str, layout: KVLayout = BIG_PAGES) -> None:
        self.device = torch.device(device)
        self.layout = layout


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("host_is_src", [True, False], ids=["load", "backup"])
def test_a_cross_device_plan_moves_every_page_exactly_once(seed: int, host_is_src: bool) -> None:
    """Host runs with scattered device pages are staged (and cut to the staging size), the rest direct;
    together they pair every source page with its destination page, once."""
    g = torch.Generator().manual_seed(seed)
    n = 200
    # Host side: a few consecutive runs in a random order; device side: runs, then scattered pages.
    cut = sorted(torch.randperm(n - 1, generator=g)[:8].add(1).tolist())
    pieces = [list(range(a, b)) for a, b in zip([0, *cut], [*cut, n], strict=True)]
    host = [p for i in torch.randperm(len(pieces), generator=g).tolist() for p in pieces[i]]
    device = list(range(n // 2)) + [n // 2 + p for p in torch.randperm(n - n // 2, generator=g).tolist()]
    host_t, device_t = torch.tensor(host), torch.tensor(device)
    cpu, gpu = _FakePool("cpu"), _FakePool("cuda")
    src, dst = (cpu, gpu) if host_is_src else (gpu, cpu)
    src_pages, dst_pages = (host_t, device_t) if host_is_src else (device_t, host_t)
    stage = 24
    old = transfer_module._STAGE_BYTES
    transfer_module._STAGE_BYTES = stage * BIG_PAGES.page_nbytes
    try:
        plan = transfer_module._plan(src, src_pages, dst, dst_pages)  # type: ignore[arg-type]
    finally:
        transfer_module._STAGE_BYTES = old
    pairs: list[tuple[int, int]] = []
    for s, d, k in plan.direct:
        pairs.extend((s + i, d + i) for i in range(k))
    assert plan.staged, "scattered device pages under host runs must be staged"
    assert plan.device_pages is not None
    staged_devices = plan.device_pages.tolist()
    for h, first, k in plan.staged:
        assert 1 <= k <= stage
        for i in range(k):
            pair = (h + i, staged_devices[first + i])
            pairs.append(pair if host_is_src else pair[::-1])
    assert sorted(pairs) == sorted(zip(src_pages.tolist(), dst_pages.tolist(), strict=True))
    assert plan.operations < n  # fewer operations than one copy per page


async def round_trip(
    device: KVPool, d_idx: torch.Tensor, host: KVPool, h_idx: torch.Tensor, g: torch.Generator
) -> None:
    """Random KV at `d_idx`: back up to `h_idx` (async), load back into other scattered device pages
    (async), copy back to host (sync), checking every byte after each leg."""
    pages = d_idx.numel() // device.page_size
    kv = torch.randn(device.layout.tokens_shape(d_idx.numel()), generator=g).to(device.layout.dtype)
    device.write_tokens(d_idx, kv.cuda())
    await copy_pages_async(device, d_idx, host, h_idx)
    assert torch.equal(host.read_tokens(h_idx).view(torch.int16), kv.view(torch.int16))
    device.buffer.zero_()
    d2 = scattered_pages(device, torch.randperm(pages, generator=g).tolist())
    await copy_pages_async(host, h_idx, device, d2)
    assert torch.equal(device.read_tokens(d2).cpu().view(torch.int16), kv.view(torch.int16))
    host.buffer.zero_()
    copy_pages(device, d2, host, h_idx)  # the synchronous path plans the same way
    assert torch.equal(host.read_tokens(h_idx).view(torch.int16), kv.view(torch.int16))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("stage_pages", [7, 1024])
async def test_scattered_device_pages_under_host_runs_are_staged_bitwise(
    stage_pages: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Backup into consecutive host pages from scattered device pages, and load back into other scattered
    device pages: staged through device buffers (cut to `stage_pages`), bitwise both ways."""
    monkeypatch.setattr(transfer_module, "_STAGE_BYTES", stage_pages * BIG_PAGES.page_nbytes)
    pages = 96
    device = opened(make_device_pool(BIG_PAGES, pages))
    host = opened(KVPool(BIG_PAGES, pages, pin_memory=True, name="host"))
    g = torch.Generator().manual_seed(21)
    d_idx = scattered_pages(device, torch.randperm(pages, generator=g).tolist())
    h_idx = alloc(host, pages * BIG_PAGES.page_size)  # consecutive
    await round_trip(device, d_idx, host, h_idx, g)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("pages", [300, 1500])
async def test_pages_scattered_on_both_sides_go_through_the_mapped_host_view_bitwise(pages: int) -> None:
    """Single pages scattered on both sides: gather/scatter kernels through the pinned pool's mapped view
    (where the platform maps pinned memory), in chunks; bitwise both ways, async and sync."""
    device = opened(make_device_pool(BIG_PAGES, pages))
    host = opened(KVPool(BIG_PAGES, pages, pin_memory=True, name="host"))
    g = torch.Generator().manual_seed(pages)
    d_idx = scattered_pages(device, torch.randperm(pages, generator=g).tolist())
    h_idx = scattered_pages(host, torch.randperm(pages, generator=g).tolist())
    plan = transfer_module._plan(device, device.page_ids(d_idx), host, host.page_ids(h_idx))
    assert plan.mapped == (transfer_module._mapped_host_view(host, device.device) is not None)
    await round_trip(device, d_idx, host, h_idx, g)
