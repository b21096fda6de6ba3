"""Layer-wise copies: layers land in order, none is readable before it has landed, and the result is the
whole copy's bit for bit."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import anyio
import anyio.to_thread
import pytest
import torch

from hicache.errors import LoadBackFailed
from hicache.memory import KVLayout, KVPool, copy_pages, make_device_pool
from hicache.memory.layerwise import (
    ALL_READY,
    CpuLayerReadiness,
    CudaLayerReadiness,
    LayerwiseCopy,
    read_layer_tokens,
)

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16, page_size=4)
P = LAYOUT.page_size

_open_pools: list[KVPool] = []


@pytest.fixture(autouse=True)
def close_pools() -> Iterator[None]:
    yield
    while _open_pools:
        _open_pools.pop().close()


def pool(num_pages: int, name: str, **kwargs: object) -> KVPool:
    p = KVPool(LAYOUT, num_pages, name=name, **kwargs)  # type: ignore[arg-type]
    _open_pools.append(p)
    return p


def pages(p: KVPool, ids: list[int]) -> torch.Tensor:
    """Token indices of pages `ids`, in that order (scattered, to exercise runs)."""
    return p.allocator.pages_to_tokens(torch.tensor(ids, dtype=torch.int64))


def fill_random(p: KVPool, indices: torch.Tensor, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(p.layout.tokens_shape(indices.numel()), generator=g).to(p.layout.dtype)
    p.write_tokens(indices, kv)
    return kv


async def test_layerwise_copy_equals_whole_copy_bitwise() -> None:
    """Scattered pages on both sides: the layer-by-layer strided gather writes exactly what a whole-page
    copy writes, and nothing else."""
    src, whole, layered = pool(8, "src", pin_memory=False), pool(8, "a"), pool(8, "b")
    s_idx = pages(src, [6, 2, 3, 0, 5])
    fill_random(src, s_idx, seed=3)
    d_idx = pages(whole, [1, 2, 7, 4, 5])
    copy_pages(src, s_idx, whole, d_idx)
    copy = LayerwiseCopy(src, s_idx, layered, d_idx)
    await copy.run()
    assert copy.readiness.done
    assert torch.equal(layered.buffer.view(torch.int16), whole.buffer.view(torch.int16))
    for layer in range(LAYOUT.num_layers):
        assert torch.equal(read_layer_tokens(layered, d_idx, layer), layered.read_tokens(d_idx)[layer])


async def test_a_layer_is_never_readable_before_it_landed() -> None:
    """The copy is held before layer 2: layers 0-1 are ready and hold their data, layer 2 is not ready and
    still zero, and a model thread waiting for layer 2 reads it only after it landed (never stale)."""
    src, dst = pool(4, "src"), pool(4, "dst")
    s_idx, d_idx = pages(src, [0, 1, 2, 3]), pages(dst, [3, 1, 0, 2])
    kv = fill_random(src, s_idx, seed=5)
    reached, release = threading.Event(), threading.Event()

    def hold_layer_2(layer: int) -> None:
        if layer == 2:
            reached.set()
            release.wait()

    copy = LayerwiseCopy(src, s_idx, dst, d_idx, before_layer=hold_layer_2)
    readiness = copy.readiness
    seen: list[torch.Tensor] = []
    waiting = threading.Event()

    def model_reads_layer_2() -> None:
        waiting.set()
        readiness.wait_layer(2)
        seen.append(read_layer_tokens(dst, d_idx, 2))

    async with anyio.create_task_group() as tg:
        tg.start_soon(copy.run)
        await anyio.to_thread.run_sync(reached.wait)
        assert [readiness.is_ready(i) for i in range(4)] == [True, True, False, False]
        assert not readiness.done
        assert torch.equal(read_layer_tokens(dst, d_idx, 1).view(torch.int16), kv[1].view(torch.int16))
        assert not read_layer_tokens(dst, d_idx, 2).any()  # not copied yet
        readiness.wait_layer(1)  # ready: returns at once on this thread
        tg.start_soon(anyio.to_thread.run_sync, model_reads_layer_2)
        await anyio.to_thread.run_sync(waiting.wait)
        assert seen == []  # the reader is blocked in wait_layer(2)
        release.set()
    assert len(seen) == 1
    assert torch.equal(seen[0].view(torch.int16), kv[2].view(torch.int16))


async def test_a_failed_copy_fails_the_waiters() -> None:
    """A copy that fails at layer 1: layer 0 stays readable, waiters on later layers raise
    `LoadBackFailed` instead of reading what never landed."""
    src, dst = pool(2, "src"), pool(2, "dst")
    idx = pages(src, [0, 1])

    def fail_at_1(layer: int) -> None:
        if layer == 1:
            raise OSError("simulated copy failure")

    copy = LayerwiseCopy(src, idx, dst, pages(dst, [0, 1]), before_layer=fail_at_1)
    with pytest.raises(LoadBackFailed):
        await copy.run()
    copy.readiness.wait_layer(0)
    assert copy.readiness.done
    with pytest.raises(LoadBackFailed):
        copy.readiness.wait_layer(3)


def test_a_cuda_enqueue_that_stops_short_fails_the_waiters() -> None:
    """A CUDA copy whose enqueue failed after layer 0's event: waiters on later layers raise
    `LoadBackFailed` (not an IndexError) and the readiness reports itself done, so no poller spins."""
    readiness = CudaLayerReadiness(3)
    assert not readiness.done
    assert not readiness.is_ready(0)
    readiness._enqueued.set()  # what `_enqueue_cuda`'s `finally` does, here with no event recorded
    assert readiness.done
    assert not readiness.is_ready(1)
    with pytest.raises(LoadBackFailed, match="layer 1"):
        readiness.wait_layer(1)


def test_readiness_arguments() -> None:
    """`wait_layer` names a bad layer; a readiness is done once its last layer landed."""
    a = CpuLayerReadiness(2)
    with pytest.raises(ValueError, match="layer"):
        a.wait_layer(2)
    a.mark_ready(0)
    assert a.is_ready(0)
    assert not a.done
    a.mark_ready(1)
    assert a.done
    assert ALL_READY.done
    assert "2/2" in repr(a)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_cuda_layerwise_copy_records_one_event_per_layer_in_order() -> None:
    """Host -> device: one event per layer; the current stream waits for layer i's event, and the data
    equals the whole copy's bit for bit."""
    host = pool(8, "host", pin_memory=True)
    device = make_device_pool(LAYOUT, 8)
    _open_pools.append(device)
    h_idx = pages(host, [6, 2, 3, 0])
    kv = fill_random(host, h_idx, seed=9)
    d_idx = pages(device, [1, 2, 7, 4])
    copy = LayerwiseCopy(host, h_idx, device, d_idx)
    assert isinstance(copy.readiness, CudaLayerReadiness)
    await copy.run()
    events = copy.readiness.events
    assert len(events) == LAYOUT.num_layers
    assert all(event.query() for event in events)
    for layer in range(LAYOUT.num_layers):
        copy.readiness.wait_layer(layer)
        got = read_layer_tokens(device, d_idx, layer).cpu()
        assert torch.equal(got.view(torch.int16), kv[layer].view(torch.int16))
