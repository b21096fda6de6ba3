"""Issue 22, "Misuse that passes": bad arguments that returned silently, or failed naming nothing.

Each test is one misuse a hostile new user tried: the call must raise `TypeError`/`ValueError` (or a
named `HiCacheError`) naming the argument, and leave the cache as it was (`sanity_check()`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import anyio.to_thread
import pytest
import torch
from controller_helpers import insert_device_chain, make_config, store_sequence, tokens

from hicache import HiCache, LeaseReleased, Namespace, PoolError
from hicache.controller.pages.release import ComponentTransfer
from storage_backends.memory import MemoryBackend
from tests.cache_internals import layered_loader_of
from tests.controller.test_layerwise_load import LayerGate

BAD_LAYERS = [2, -1, True, 1.0, "0"]
"""The test layout has 2 layers: out of range, negative, a bool, a float, a str."""


@pytest.fixture
async def backend() -> AsyncIterator[MemoryBackend]:
    async with MemoryBackend(namespace_digest=Namespace().digest) as b:
        yield b


@pytest.mark.parametrize("layer", BAD_LAYERS, ids=repr)
async def test_wait_layer_names_a_bad_layer_on_a_lease_with_nothing_landing(layer: object) -> None:
    """The check depended on the tier: a lease whose prefix had landed (or a cache without layer-wise
    load-back) returned at once for any `layer`."""
    async with HiCache(make_config()) as cache:
        await insert_device_chain(cache, tokens(0, 16))
        lease = await cache.acquire("r", tokens(0, 16))
        assert lease.cached_len == 16
        with pytest.raises(ValueError, match=r"^layer: expected an int in \[0, 2\)"):
            lease.layers.wait_layer(layer)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"^layer: expected an int in \[0, 2\)"):
            await lease.layers.wait_layer_async(layer)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"^layer: expected an int in \[0, 2\)"):
            cache.layer_readiness(lease.device_indices).wait_layer(layer)  # type: ignore[arg-type]
        lease.layers.wait_layer(1)
        cache.release(lease)
        cache.sanity_check()


@pytest.mark.parametrize("layer", BAD_LAYERS, ids=repr)
async def test_wait_layer_names_a_bad_layer_on_a_lease_still_landing(
    backend: MemoryBackend, layer: object
) -> None:
    """The same check on a lease whose layer-wise load-back is held before layer 1: one error."""
    seq = tokens(1, 16)
    gate = LayerGate(1)
    async with HiCache(make_config(layerwise_load_back=True), storage=backend) as cache:
        await store_sequence(backend, cache, seq)
        layered_loader_of(cache).before_layer = gate
        lease = await cache.acquire("r", seq)
        await anyio.to_thread.run_sync(gate.reached.wait)
        with pytest.raises(ValueError, match=r"^layer: expected an int in \[0, 2\)"):
            lease.layers.wait_layer(layer)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"^layer: expected an int in \[0, 2\)"):
            await lease.layers.wait_layer_async(layer)  # type: ignore[arg-type]
        gate.release()
        await lease.layers.wait_layer_async(1)
        cache.release(lease)
        await cache.wait_idle()
        while layered_loader_of(cache).in_flight:
            await anyio.lowlevel.checkpoint()
        cache.sanity_check()


async def test_a_released_lease_s_layers_are_refused_once_its_pages_are_someone_else_s() -> None:
    """After `release(lease)` and an `alloc_device` that evicted the prefix, `wait_layer(0)` said ready:
    the handle outlived its lease. It raises `LeaseReleased` (a `ValueError`) from the release on."""
    async with HiCache(make_config()) as cache:
        await insert_device_chain(cache, tokens(0, 16))
        lease = await cache.acquire("r", tokens(0, 16))
        cache.release(lease)
        taken = await cache.alloc_device(32 * 4)  # every device page: the prefix is evicted
        assert taken is not None
        assert bool(torch.isin(lease.device_indices, taken).all())
        with pytest.raises(LeaseReleased, match=r"^layer 0: the lease of request 'r' was released"):
            lease.layers.wait_layer(0)
        with pytest.raises(LeaseReleased):
            await lease.layers.wait_layer_async(0)
        with pytest.raises(LeaseReleased):
            lease.layers.is_ready(0)
        with pytest.raises(LeaseReleased, match=r"^lease: the lease of request 'r' was already released"):
            await cache.insert(lease, tokens(0, 16), lease.device_indices)
        cache.release(lease, taken)
        cache.sanity_check()


@pytest.mark.parametrize(
    ("indices", "error", "pattern"),
    [
        (torch.tensor([128]), ValueError, r"^device_indices: token indices must lie in \[0, 128\)"),
        (torch.tensor([-1, 0]), ValueError, r"^device_indices: token indices must lie in \[0, 128\)"),
        (torch.zeros(2, 4, dtype=torch.int64), TypeError, r"^device_indices: expected a 1-D tensor"),
    ],
    ids=["past-the-end", "negative", "2-D"],
)
async def test_layer_readiness_names_indices_outside_the_device_pool(
    indices: torch.Tensor, error: type, pattern: str
) -> None:
    """Out-of-range, negative and 2-D indices returned "ready"."""
    async with HiCache(make_config()) as cache:
        with pytest.raises(error, match=pattern):
            cache.layer_readiness(indices)


async def test_release_refuses_indices_that_are_not_a_tensor() -> None:
    """`release(lease, new.numpy())` returned and freed nothing: the caller's pages leaked."""
    async with HiCache(make_config()) as cache:
        lease = await cache.acquire("r", tokens(0, 8))
        new = await cache.alloc_device(8)
        assert new is not None
        free_before = cache.statistics().device_pool.free_pages
        with pytest.raises(TypeError, match=r"^device_indices: expected a 1-D int64 CPU tensor, got ndarray"):
            cache.release(lease, new.numpy())  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"^device_indices: expected dtype torch.int64"):
            cache.release(lease, new.to(torch.int32))
        assert lease.active  # nothing changed
        assert cache.statistics().device_pool.free_pages == free_before
        cache.release(lease, new)
        assert cache.statistics().device_pool.free_pages == free_before + 2
        cache.sanity_check()


async def test_the_device_pool_refuses_to_free_pages_the_tree_holds() -> None:
    """`cache.device_pool.free(idx)` on a lease's prefix (the tree's pages) succeeded, and the next
    `sanity_check()` failed: the pool ignored its own owner tags."""
    async with HiCache(make_config()) as cache:
        await insert_device_chain(cache, tokens(0, 16))
        lease = await cache.acquire("r", tokens(0, 16))
        with pytest.raises(PoolError, match=r"^indices: page\(s\) \[0, 1, 2, 3\] are not held by the caller"):
            cache.device_pool.free(lease.device_indices)
        cache.sanity_check()
        cache.release(lease)
        new = await cache.alloc_device(4)
        assert new is not None
        cache.device_pool.free(new)  # the caller's own pages still free
        cache.sanity_check()


async def test_prefetch_refuses_a_match_for_other_tokens(backend: MemoryBackend) -> None:
    """A `MatchResult` for other tokens was trusted (only the hash chain saved it)."""
    async with HiCache(make_config(), storage=backend) as cache:
        await insert_device_chain(cache, tokens(100, 16))
        other = cache.match(tokens(100, 16))
        assert other.device_len == 16
        with pytest.raises(ValueError, match=r"^match: it matched other tokens"):
            await cache.prefetch("r", tokens(0, 32), match=other)
        assert cache.statistics().prefetches_in_flight == 0
        cache.sanity_check()


async def test_prefetch_still_takes_the_match_of_its_own_tokens(backend: MemoryBackend) -> None:
    async with HiCache(make_config(), storage=backend) as cache:
        seq = tokens(0, 32)
        await insert_device_chain(cache, seq[:8])
        await store_sequence(backend, cache, seq)
        prefetch = await cache.prefetch("r", seq, match=cache.match(seq))
        assert prefetch is not None
        outcome = await cache.commit_prefetch("r")
        assert outcome.loaded_tokens == 24
        cache.sanity_check()


async def test_calls_name_an_argument_of_the_wrong_type(backend: MemoryBackend) -> None:
    """Each of these failed with an AttributeError or a TypeError naming nothing."""
    async with HiCache(make_config(), storage=backend) as cache:
        seq = tokens(0, 16)
        lease = await cache.acquire("lease", seq)
        host = ComponentTransfer("swa", cache.device_pool, torch.arange(4))
        calls = [
            ("match", lambda: cache.prefetch("r", seq, match="x")),
            ("match", lambda: cache.load_back(None)),
            ("match", lambda: cache.load_back_layerwise(None)),
            ("match", lambda: cache.load_back_layerwise("x")),
            ("match", lambda: cache.load_back_layerwise(lease)),
            ("request_id", lambda: cache.commit_prefetch([])),
            ("request_id", lambda: cache.cancel_prefetch([])),
            ("transfers", lambda: cache.prefetch("r", seq, transfers=["x"])),
            ("transfers", lambda: cache.prefetch("r", seq, transfers=None)),
            ("transfers", lambda: cache.prefetch("r", seq, transfers=host)),
            ("slots", lambda: cache.alloc_components_async(None)),
            ("slots", lambda: cache.alloc_components_async(["swa"])),
        ]
        for name, call in calls:
            with pytest.raises(TypeError, match=rf"^{name}: expected"):
                await call()  # type: ignore[no-untyped-call]
        with pytest.raises(TypeError, match=r"^name: expected a component name"):
            cache.alloc_component(["swa"], 4)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"^request_id: expected"):
            cache.get_prefetch([])  # type: ignore[arg-type]
        assert cache.statistics().prefetches_in_flight == 0
        cache.release(lease)
        cache.sanity_check()
