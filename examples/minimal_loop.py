"""Embed hicache in an asyncio serving loop: two requests share a prefix; the second reuses its KV."""

from __future__ import annotations

import asyncio

import torch

from hicache import HiCache, HiCacheConfig, KVLayout

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32, page_size=4)


def fake_model_kv(tokens: torch.Tensor) -> torch.Tensor:
    """Stand-in for a model's prefill: K/V of `tokens` in the pool layout (L, 2, n, H, D)."""
    return tokens.float().view(1, 1, -1, 1, 1).expand(*LAYOUT.tokens_shape(tokens.numel())).clone()


async def serve(cache: HiCache, request_id: str, tokens: torch.Tensor) -> None:
    lease = await cache.acquire(request_id, tokens)  # match, prefetch from storage, load host hits back
    prefix_kv = cache.device_pool.read_tokens(lease.device_indices)  # what the model would attend to
    assert torch.equal(prefix_kv, fake_model_kv(tokens)[:, :, : lease.cached_len])
    new = tokens.numel() - lease.cached_len
    indices = await cache.alloc_device(-(-new // LAYOUT.page_size) * LAYOUT.page_size)  # evicts if needed
    assert indices is not None, "device pool exhausted"
    cache.device_pool.write_tokens(indices[:new], fake_model_kv(tokens)[:, :, lease.cached_len :])
    await cache.insert(lease, tokens, torch.cat([lease.device_indices, indices]))
    print(f"{request_id}: {tokens.numel()} tokens, reused {lease.cached_len} {lease.hit_tokens_by_tier}")


async def main() -> None:
    config = HiCacheConfig(layout=LAYOUT, device_pages=32, host_pages=64, storage_url="memory://")
    async with HiCache(config) as cache:
        system = torch.arange(100, 116)
        await serve(cache, "alice", torch.cat([system, torch.tensor([1, 2, 3, 4, 5])]))
        await serve(cache, "bob", torch.cat([system, torch.tensor([9, 8, 7])]))
        print(cache)


if __name__ == "__main__":
    asyncio.run(main())
