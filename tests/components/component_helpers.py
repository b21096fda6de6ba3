"""Helpers for hybrid-cache tests: a small config with a sliding window and a Mamba state, and storage
pages written as another instance would."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from cache_internals import component_pools_of, host_pool_of, tree_of

from hicache import HiCache, HiCacheConfig, KVLayout, Lease
from hicache.components import MambaState, SlidingWindow, component_storage_key
from hicache.keys import ROOT_HASH, as_key_bytes, chained_page_hashes
from storage_backends.memory import MemoryBackend

PAGE = 4
WINDOW = 16
STATE_NBYTES = 16
LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32, page_size=PAGE)
SWA_LAYOUT = KVLayout.flat(8, PAGE)


def hybrid_config(*names: str, **overrides: object) -> HiCacheConfig:
    """4-token pages; `swa` (16-token window, 16 pages per tier) and/or `mamba` (8 slots per tier)."""
    comps: list[object] = []
    for name in names or ("swa", "mamba"):
        if name == "swa":
            comps.append(SlidingWindow(WINDOW, SWA_LAYOUT, device_pages=16, host_pages=16))
        else:
            comps.append(MambaState(STATE_NBYTES, device_slots=8, host_slots=8))
    options: dict[str, object] = {
        "layout": LAYOUT,
        "device_pages": 32,
        "host_pages": 64,
        "prefetch_threshold": 8,
        "storage_batch_pages": 2,
        "prefetch_stop_policy": "wait_complete",
        "components": tuple(comps),
    }
    options.update(overrides)
    return HiCacheConfig(**options)  # type: ignore[arg-type]


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def base_payload(key: bytes) -> torch.Tensor:
    """Deterministic full-attention KV for `key`'s tokens, shaped for `KVPool.write_tokens`."""
    ids = torch.frombuffer(bytearray(key), dtype=torch.int64).to(torch.float32)
    n = ids.numel()
    shape = LAYOUT.tokens_shape(n)
    return (
        (ids.view(1, 1, n, 1, 1) * 10 + torch.arange(LAYOUT.head_dim, dtype=torch.float32))
        .expand(shape)
        .contiguous()
    )


def swa_payload(key: bytes) -> torch.Tensor:
    """Deterministic window KV (8 bytes per token: the token id's low bytes, reversed)."""
    raw = torch.frombuffer(bytearray(key), dtype=torch.uint8).view(-1, 8).flip(1)
    return raw.reshape(SWA_LAYOUT.tokens_shape(raw.shape[0])).contiguous()


def state_payload(key: bytes) -> torch.Tensor:
    """A deterministic state for the prefix `key`: bytes derived from its length and last token."""
    last = int.from_bytes(key[-8:], "little")
    n = len(key) // 8
    data = torch.tensor([(last * 7 + n + i) % 251 for i in range(STATE_NBYTES)], dtype=torch.uint8)
    return data.view(1, 1, 1, 1, STATE_NBYTES)


async def store_hybrid(
    backend: MemoryBackend, cache: HiCache, seq: Sequence[int], *, with_state: bool = True
) -> list[str]:
    """Put `seq`'s full-attention pages, the window's pages at its end and its end state into storage."""
    key = as_key_bytes(list(seq))
    hashes = chained_page_hashes(key, PAGE, cache.config.namespace, ROOT_HASH)
    n = len(hashes)
    data = base_payload(key[: n * PAGE * 8])
    pages = data.view(LAYOUT.num_layers, 2, n, PAGE, 1, LAYOUT.head_dim).permute(2, 0, 1, 3, 4, 5)
    keys = [h.hex() for h in hashes]
    views = [memoryview(pages[i].contiguous().numpy().tobytes()) for i in range(n)]
    window_pages = min(n, -(-WINDOW // PAGE))
    for i in range(n - window_pages, n):
        keys.append(component_storage_key(hashes[i], "swa"))
        views.append(memoryview(swa_payload(key[i * PAGE * 8 : (i + 1) * PAGE * 8]).numpy().tobytes()))
    if with_state:
        keys.append(component_storage_key(hashes[-1], "mamba"))
        views.append(memoryview(state_payload(key[: n * PAGE * 8]).numpy().tobytes()))
    ok = await backend.put(keys, views)
    assert all(ok)
    return keys


async def hybrid_request(
    cache: HiCache, seq: list[int], request_id: str
) -> tuple[Lease, torch.Tensor, dict[str, torch.Tensor]]:
    """A hybrid request's lease, its new full-attention pages and its window + state slots, written."""
    lease = await cache.acquire(request_id, seq)
    key = as_key_bytes(seq)
    n = len(seq)
    new = await cache.alloc_device(n - lease.cached_len)
    assert new is not None
    cache.device_pool.write_tokens(new, base_payload(key[lease.cached_len * 8 :]))
    swa = cache.alloc_component("swa", WINDOW)
    state = cache.alloc_component("mamba", 1)
    assert swa is not None
    assert state is not None
    cache.component_pool("swa").write_tokens(swa, swa_payload(key[(n - WINDOW) * 8 :]))
    cache.component_pool("mamba").write_tokens(state, state_payload(key))
    return lease, new, {"swa": swa, "mamba": state}


async def serve_hybrid(cache: HiCache, seq: list[int]) -> None:
    """Serve `seq` as a hybrid model would: full-attention KV, the window's KV and the end state."""
    lease, new, comps = await hybrid_request(cache, seq, f"fill-{seq[-1]}")
    await cache.insert(lease, seq, torch.cat([lease.device_indices, new]), comps)


def cache_snapshot(cache: HiCache) -> tuple[Any, ...]:
    """Everything a refused call must leave unchanged: statistics, every pool page's owner, every node."""

    def as_list(t: torch.Tensor | None) -> list[int] | None:
        return None if t is None else t.tolist()

    tree = tree_of(cache)
    nodes = sorted(
        (
            n.key,
            as_list(n.device_value),
            as_list(n.host_value),
            as_list(n.backup_pending),
            n.device_lock,
            n.host_lock,
            n.hit_count,
            n.last_access,
            sorted(
                (name, as_list(d.device_value), as_list(d.host_value), d.device_lock, d.host_lock)
                for name, d in tree.component_info(n.ref).items()
            ),
        )
        for n in map(tree.node_info, tree.iter_nodes())
    )
    pools = [
        cache.device_pool,
        host_pool_of(cache),
        *(p for pair in component_pools_of(cache).values() for p in pair),
    ]
    return cache.statistics(), nodes, [pool.owner_tags().tolist() for pool in pools]
