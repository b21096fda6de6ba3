"""An acquire with a storage hit asks the tree, and the tree alone decides: the controller matches once
(after its prefetch, for the load-back and the lease), admits the prefetch on a `peek` that changes
nothing, and hands the loaded pages to the tree's `attach_loaded` instead of walking nodes itself."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Callable

import pytest
import torch
from cache_internals import tree_of
from controller_helpers import make_config, page_payload, store_sequence, tokens

from hicache import HiCache, NodeRef
from hicache.keys import Namespace, as_key_bytes
from storage_backends.memory import MemoryBackend


@pytest.fixture
async def backend() -> AsyncIterator[MemoryBackend]:
    async with MemoryBackend(namespace_digest=Namespace(model_id="controller-tests").digest) as b:
        yield b


def count_calls_from_outside_the_tree(
    monkeypatch: pytest.MonkeyPatch, obj: object, name: str, calls: list[str]
) -> None:
    """Wrap method `name` of `obj`'s class to record each call on `obj` made by code outside
    `hicache.tree` (the tree's own operations may use its public methods internally). The class, not the
    instance: a `RadixTree` has slots and no `__dict__`."""
    original: Callable[..., object] = getattr(type(obj), name)

    def counting(self: object, *args: object, **kwargs: object) -> object:
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if self is obj and not str(caller).startswith("hicache.tree"):
            calls.append(f"{name} from {caller}")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(obj), name, counting)


async def test_an_acquire_with_a_storage_hit_matches_the_tree_once(
    backend: MemoryBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Guards the finding of issue 11: one acquire with a storage hit called `match_prefix` four times
    (each splitting nodes and bumping the LRU clock) and re-walked the tree after the load-back."""
    async with HiCache(make_config(), storage=backend) as cache:
        seq = tokens(100, 32)
        await store_sequence(backend, cache, seq)
        tree = tree_of(cache)
        matches: list[str] = []
        peeks: list[str] = []
        attaches: list[str] = []
        count_calls_from_outside_the_tree(monkeypatch, tree, "match_prefix", matches)
        count_calls_from_outside_the_tree(monkeypatch, tree, "peek", peeks)
        count_calls_from_outside_the_tree(monkeypatch, tree, "attach_loaded", attaches)
        lease = await cache.acquire("r", seq)
        assert lease.cached_len == 32
        assert lease.hit_tokens_by_tier["storage"] == 32
        assert len(matches) == 1, matches
        assert len(peeks) == 1, peeks
        assert len(attaches) == 1, attaches  # the storage pages went host -> device through the tree
        assert isinstance(lease.node, NodeRef)
        # The storage pages' KV, now on the device where the lease says.
        assert torch.equal(
            cache.device_pool.read_tokens(lease.device_indices), page_payload(as_key_bytes(seq))
        )
        cache.release(lease)
        cache.sanity_check()


async def test_an_acquire_without_storage_matches_once_and_never_peeks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without a storage tier there is nothing to admit: one match, no peek."""
    async with HiCache(make_config()) as cache:
        tree = tree_of(cache)
        matches: list[str] = []
        peeks: list[str] = []
        count_calls_from_outside_the_tree(monkeypatch, tree, "match_prefix", matches)
        count_calls_from_outside_the_tree(monkeypatch, tree, "peek", peeks)
        lease = await cache.acquire("r", tokens(0, 16))
        assert (len(matches), len(peeks)) == (1, 0)
        assert lease.cached_len == 0
        assert lease.node == tree.root
        cache.release(lease)
        cache.sanity_check()


async def test_an_acquire_told_not_to_prefetch_never_asks_storage(
    backend: MemoryBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Guards the vLLM connector's synchronous host-hit load: pages evicted between the scheduler's lookup
    and the load used to send `acquire` to storage inside the engine step. With `prefetch=False` it asks
    storage nothing (no lookup, no read) and holds what the device and host tiers have; the next plain
    acquire still loads the storage hit."""
    async with HiCache(make_config(), storage=backend) as cache:
        seq = tokens(100, 32)
        await store_sequence(backend, cache, seq)
        asked: list[str] = []
        for name in ("exists", "get"):
            original = getattr(backend, name)

            async def recording(*args: object, _name: str = name, _call: object = original) -> object:
                asked.append(_name)
                return await _call(*args)  # type: ignore[operator]

            monkeypatch.setattr(backend, name, recording)
        lease = await cache.acquire("r", seq, prefetch=False)
        assert lease.cached_len == 0
        assert lease.prefetch is None
        assert asked == []
        cache.release(lease)
        lease = await cache.acquire("r", seq)
        assert lease.hit_tokens_by_tier["storage"] == 32
        assert "exists" in asked
        assert "get" in asked
        cache.release(lease)
        with pytest.raises(TypeError, match="prefetch"):
            await cache.acquire("r", seq, prefetch=1)  # type: ignore[arg-type]
        cache.sanity_check()
