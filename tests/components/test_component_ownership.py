"""Component slot misuse: `insert(components=...)` and `release(components=...)` take only slots the
caller got from `alloc_component` and still holds.

Out-of-range, negative, misaligned, repeated, never allocated, tree-held, host-pool and unknown-component
slots are refused with an error naming `components`; nothing changes (statistics, every page's owner,
every node), `sanity_check()` passes, and the real slots then insert and read back bitwise (issue 9,
finding 1, for hybrid components).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from cache_internals import tree_of
from component_helpers import (
    PAGE,
    WINDOW,
    cache_snapshot,
    hybrid_config,
    hybrid_request,
    state_payload,
    swa_payload,
    tokens,
)

from hicache import HiCache
from hicache.errors import PoolError
from hicache.keys import as_key_bytes
from hicache.memory import Owner

snapshot = cache_snapshot


def run(start: int) -> torch.Tensor:
    """The slot indices of one window page starting at `start`."""
    return torch.arange(start, start + PAGE, dtype=torch.int64)


def open_hybrid() -> HiCache:
    """A small cache with a sliding window and a Mamba state; open it with `async with` in the test."""
    return HiCache(hybrid_config())


def bad_components(good: dict[str, torch.Tensor], tree: dict[str, torch.Tensor]) -> dict[str, Any]:
    swa, state = good["swa"], good["mamba"]
    swa_pages = 16 * PAGE  # hybrid_config: 16 window pages, 8 state slots per tier
    return {
        "swa_out_of_range": {"swa": torch.cat([swa[:-PAGE], run(swa_pages)]), "mamba": state},
        "swa_negative": {"swa": torch.cat([swa[:-PAGE], run(-PAGE)]), "mamba": state},
        "swa_misaligned": {"swa": swa + 1, "mamba": state},
        "swa_duplicated": {"swa": torch.cat([swa[:-PAGE], swa[:PAGE]]), "mamba": state},
        "swa_in_the_tree": {"swa": torch.cat([swa[:-PAGE], tree["swa"][:PAGE]]), "mamba": state},
        "mamba_in_the_tree": {"swa": swa, "mamba": tree["mamba"]},
        "mamba_never_allocated": {"swa": swa, "mamba": tree["mamba_free"]},
        "mamba_out_of_range": {"swa": swa, "mamba": torch.tensor([8])},
        "mamba_negative": {"swa": swa, "mamba": torch.tensor([-1])},
        "mamba_host_index": {"swa": swa, "mamba": tree["mamba_host"]},
        "unknown_component": {"swa": swa, "mamba": state, "nope": state},
    }


BAD_COMPONENT_KINDS = [
    "mamba_host_index",
    "mamba_in_the_tree",
    "mamba_negative",
    "mamba_never_allocated",
    "mamba_out_of_range",
    "swa_duplicated",
    "swa_in_the_tree",
    "swa_misaligned",
    "swa_negative",
    "swa_out_of_range",
    "unknown_component",
]


async def hybrid_setup(cache: HiCache) -> tuple[Any, list[int], torch.Tensor, dict[str, Any], dict[str, Any]]:
    first = tokens(100, 32)
    lease, new, comps = await hybrid_request(cache, first, "first")
    await cache.insert(lease, first, torch.cat([lease.device_indices, new]), comps)
    await cache.wait_idle()
    held = await cache.acquire("held", first)
    tree = dict(held.component_indices)
    host_state = tree_of(cache).component_value(held.node, "mamba", "host")
    assert host_state is not None
    tree["mamba_host"] = host_state  # the host pool's slot of the state
    cache.release(held)
    seq = tokens(700, 32)
    lease, new, comps = await hybrid_request(cache, seq, "r")
    state_pool = cache.component_pool("mamba")
    tags = state_pool.owner_tags()
    tree["mamba_free"] = (tags == Owner.FREE).nonzero().flatten()[:1]
    assert int(host_state) != int(comps["mamba"])  # not numerically the caller's own slot
    return lease, seq, new, comps, tree


@pytest.mark.parametrize("kind", BAD_COMPONENT_KINDS)
async def test_component_insert_refuses_slots_the_caller_does_not_hold(kind: str) -> None:
    """`insert(components=...)` with a bad window or state slot: refused naming `components`, nothing
    changes, then the real slots insert and the window and state read back bitwise."""
    async with open_hybrid() as cache:
        lease, seq, new, comps, tree = await hybrid_setup(cache)
        bad = bad_components(comps, tree)[kind]
        before = snapshot(cache)
        with pytest.raises(ValueError, match="components"):
            await cache.insert(lease, seq, torch.cat([lease.device_indices, new]), bad)
        assert snapshot(cache) == before
        assert lease.active
        cache.sanity_check(
            held_device=[new], held_components={"swa": [comps["swa"]], "mamba": [comps["mamba"]]}
        )
        await cache.insert(lease, seq, torch.cat([lease.device_indices, new]), comps)
        await cache.wait_idle()
        cache.sanity_check()
        for s in (seq, tokens(100, 32)):
            again = await cache.acquire(f"again-{s[0]}", s)
            assert again.cached_len == 32
            key = as_key_bytes(s)
            window = again.component_indices["swa"]
            swa_kv = cache.component_pool("swa").read_tokens(window[window.numel() - WINDOW :])
            assert torch.equal(swa_kv, swa_payload(key[(32 - WINDOW) * 8 :]))
            state = cache.component_pool("mamba").read_tokens(again.component_indices["mamba"])
            assert torch.equal(state, state_payload(key))
            cache.release(again)
        cache.sanity_check()


async def test_alloc_component_slots_release_and_double_release() -> None:
    """Slots from `alloc_component` given back with `release(components=...)` are freed once; the tree's
    slots and already freed slots are refused naming `components`."""
    async with open_hybrid() as cache:
        lease, _seq, new, comps, tree = await hybrid_setup(cache)
        before = snapshot(cache)
        with pytest.raises(ValueError, match=r"components\['mamba'\]"):
            cache.release(lease, new, {"swa": comps["swa"], "mamba": tree["mamba"]})
        assert snapshot(cache) == before
        assert lease.active
        cache.release(lease, new, comps)
        assert not lease.active
        cache.sanity_check()
        with pytest.raises(PoolError, match=r"components\['swa'\]"):
            cache.release(lease, None, {"swa": comps["swa"]})
        cache.sanity_check()
