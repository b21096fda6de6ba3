"""Layer-wise load-back through the cache: `acquire` returns before the copy landed, every reader of the
loaded pages (this request and any other that matches them) waits per layer, the result equals a whole
load-back bit for bit, and the accounting holds throughout."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator

import anyio
import anyio.to_thread
import pytest
import torch

from hicache import HiCache, Namespace
from hicache.keys import as_key_bytes
from hicache.memory.layerwise import ALL_READY, HeldReadiness, read_layer_tokens
from storage_backends.memory import MemoryBackend
from tests.cache_internals import layered_loader_of
from tests.controller.controller_helpers import LAYOUT, make_config, page_payload, store_sequence, tokens


@pytest.fixture
async def backend() -> AsyncIterator[MemoryBackend]:
    async with MemoryBackend(namespace_digest=Namespace().digest) as b:
        yield b


class LayerGate:
    """Holds the layer-wise copy before layer `layer` until `release()`; `reached` is set once held."""

    def __init__(self, layer: int) -> None:
        self.layer = layer
        self.reached = threading.Event()
        self._release = threading.Event()

    def __call__(self, layer: int) -> None:
        if layer == self.layer:
            self.reached.set()
            self._release.wait()

    def release(self) -> None:
        self._release.set()


async def test_acquire_returns_before_the_copy_and_layers_land_in_order(backend: MemoryBackend) -> None:
    """A storage hit loaded back layer-wise: the lease covers the whole prefix while layer 1 is held back;
    layer 0 is readable, layer 1 is not until released; the pages then hold exactly the stored KV and the
    accounting is exact (the pages are the tree's, locked until the copy landed)."""
    seq = tokens(1, 16)
    gate = LayerGate(1)
    async with HiCache(make_config(layerwise_load_back=True), storage=backend) as cache:
        await store_sequence(backend, cache, seq)
        layered_loader_of(cache).before_layer = gate
        lease = await cache.acquire("r1", seq)
        assert lease.cached_len == 16
        assert lease.hit_tokens_by_tier["storage"] == 16
        await anyio.to_thread.run_sync(gate.reached.wait)
        assert lease.layers.is_ready(0)
        assert not lease.layers.is_ready(1)
        cache.sanity_check()
        expected = page_payload(as_key_bytes(seq))
        await anyio.to_thread.run_sync(lease.layers.wait_layer, 0)
        assert torch.equal(read_layer_tokens(cache.device_pool, lease.device_indices, 0), expected[0])
        assert layered_loader_of(cache).in_flight == 1
        gate.release()
        await anyio.to_thread.run_sync(lease.layers.wait_layer, 1)
        assert torch.equal(cache.device_pool.read_tokens(lease.device_indices), expected)
        await cache.wait_idle()
        while layered_loader_of(cache).in_flight:  # the load's task unlocks on the loop after landing
            await anyio.lowlevel.checkpoint()
        cache.release(lease)
        cache.sanity_check()


async def test_a_second_request_on_the_loading_prefix_waits_for_the_same_layers(
    backend: MemoryBackend,
) -> None:
    """Another request matching the host hit still being copied shares the landing load (no second copy:
    the same pages, which are still no device hit of the tree) and gets its readiness: it cannot read
    layer 1 before the first request's copy landed it."""
    seq = tokens(1, 16)
    gate = LayerGate(1)
    async with HiCache(make_config(layerwise_load_back=True), storage=backend) as cache:
        await store_sequence(backend, cache, seq)
        layered_loader_of(cache).before_layer = gate
        first = await cache.acquire("r1", seq)
        try:
            await anyio.to_thread.run_sync(gate.reached.wait)
            assert cache.match(seq).device_len == 0  # landing pages are their readers' only
            second = await cache.acquire("r2", seq)
            assert second.hit_tokens_by_tier["host"] == 16
            assert torch.equal(second.device_indices, first.device_indices)
            assert not second.layers.is_ready(1)
            assert isinstance(second.layers, HeldReadiness)
            assert second.layers.inner is not ALL_READY
            cache.sanity_check()
        finally:
            gate.release()
        await anyio.to_thread.run_sync(second.layers.wait_layer, 1)
        while layered_loader_of(cache).in_flight:
            await anyio.lowlevel.checkpoint()
        third = await cache.acquire("r3", seq)
        assert third.hit_tokens_by_tier["device"] == 16
        assert torch.equal(third.device_indices, first.device_indices)
        assert isinstance(third.layers, HeldReadiness)
        assert third.layers.inner is ALL_READY
        for lease in (first, second, third):
            cache.release(lease)
        cache.sanity_check()


async def test_layerwise_equals_whole_load_back_bitwise(backend: MemoryBackend) -> None:
    """The same storage hit loaded whole and layer-wise gives the same K/V bit for bit."""
    seq = tokens(100, 24)
    got = {}
    for layerwise in (False, True):
        config = make_config(layerwise_load_back=layerwise)
        async with (
            MemoryBackend(namespace_digest=Namespace().digest) as store,
            HiCache(config, storage=store) as cache,
        ):
            await store_sequence(store, cache, seq)
            lease = await cache.acquire("r", seq)
            for layer in range(LAYOUT.num_layers):
                await lease.layers.wait_layer_async(layer)
            got[layerwise] = cache.device_pool.read_tokens(lease.device_indices)
            cache.release(lease)
            await cache.wait_idle()
            cache.sanity_check()
    assert torch.equal(got[True].view(torch.int32), got[False].view(torch.int32))


async def test_aclose_waits_for_a_layerwise_copy_in_flight(backend: MemoryBackend) -> None:
    """Closing while a layer-wise copy is held: no pool closes before the copy landed."""
    seq = tokens(1, 16)
    gate = LayerGate(1)
    cache = HiCache(make_config(layerwise_load_back=True), storage=backend)
    closed_while_held: list[bool] = []
    async with anyio.create_task_group() as tg, cache:
        await store_sequence(backend, cache, seq)
        layered_loader_of(cache).before_layer = gate
        lease = await cache.acquire("r1", seq)
        await anyio.to_thread.run_sync(gate.reached.wait)
        cache.release(lease)

        async def release_once_aclose_waits() -> None:
            await anyio.wait_all_tasks_blocked()
            closed_while_held.append(cache.device_pool.closed)
            gate.release()

        tg.start_soon(release_once_aclose_waits)
    assert closed_while_held == [False]
    assert cache.device_pool.closed
