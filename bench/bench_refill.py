"""Refill rescue: prefill saved with `refill_under_unbacked="drop"` against `"backup_then_attach"`.

A workload where drops happen: each request's first half was just computed on the device by an earlier
request and is not backed up yet (write-through-selective with a threshold not reached, standing in for a
backup still queued under write-through), while storage holds the whole sequence (written by another
instance). Its prefetch then anchors at the root and its refill would hang below the fresh device prefix:
`drop` releases the refill and the request recomputes the second half; `backup_then_attach` backs the
first half up and attaches the refill. The host pool is small, so some rescues find no room and drop.

Reports per policy: prefetches committed, dropped, rescued; prefill tokens saved (cached tokens over all
requests); and whether every cached token's K/V equals the stored K/V bit for bit (the output a
recompute would give). Usage: python bench/bench_refill.py [--requests 40]. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import anyio
import torch

from hicache import HiCache, HiCacheConfig, KVLayout, Namespace
from hicache.keys import ROOT_HASH, as_key_bytes, chained_page_hashes
from storage_backends.memory import MemoryBackend

PAGE = 16
LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=32, dtype=torch.float32, page_size=PAGE)
HALF = 256


def payload(key: bytes) -> torch.Tensor:
    """Deterministic K/V of `key`'s tokens (a stand-in for what the model computes)."""
    ids = torch.frombuffer(bytearray(key), dtype=torch.int64).to(torch.float32)
    shape = LAYOUT.tokens_shape(ids.numel())
    return (
        (ids.view(1, 1, -1, 1, 1) + torch.arange(shape[0]).view(-1, 1, 1, 1, 1) * 0.5)
        .expand(shape)
        .contiguous()
    )


async def store(backend: MemoryBackend, namespace: Namespace, seq: list[int]) -> None:
    key = as_key_bytes(seq)
    hashes = chained_page_hashes(key, PAGE, namespace, ROOT_HASH)
    data = payload(key)
    n = len(hashes)
    pages = data.view(LAYOUT.num_layers, 2, n, PAGE, LAYOUT.num_kv_heads, LAYOUT.head_dim).permute(
        2, 0, 1, 3, 4, 5
    )
    ok = await backend.put(
        [h.hex() for h in hashes], [memoryview(pages[i].contiguous().numpy().tobytes()) for i in range(n)]
    )
    assert all(ok)


async def run(policy: str, requests: int) -> dict[str, object]:
    namespace = Namespace(model_id="bench-refill")
    config = HiCacheConfig(
        layout=LAYOUT,
        device_pages=requests * HALF // PAGE + 64,
        host_pages=(requests // 2) * HALF // PAGE + 2 * HALF // PAGE * 2,
        write_policy="write_through_selective",
        write_through_threshold=100,
        prefetch_threshold=PAGE,
        namespace=namespace,
        refill_under_unbacked=policy,
    )
    counts = {"committed": 0, "dropped": 0, "rescued": 0}
    saved = 0
    bitwise = True
    async with (
        MemoryBackend(namespace_digest=config.namespace.digest) as backend,
        HiCache(config, storage=backend) as cache,
    ):
        for r in range(requests):
            seq = list(range(r * 10_000 + 1, r * 10_000 + 1 + 2 * HALF))
            # The first half, just computed here (fresh on the device, not backed up).
            lease = await cache.acquire(f"fill-{r}", seq[:HALF])
            new = await cache.alloc_device(HALF)
            assert new is not None
            cache.device_pool.write_tokens(new, payload(as_key_bytes(seq[:HALF])))
            await cache.insert(lease, seq[:HALF], new)
            # The whole sequence, stored by another instance.
            await store(backend, cache.config.namespace, seq)
            lease = await cache.acquire(f"r{r}", seq)
            if lease.prefetch is not None:
                counts[lease.prefetch.status] = counts.get(lease.prefetch.status, 0) + 1
                counts["rescued"] += lease.prefetch.rescued
            saved += lease.cached_len
            got = cache.device_pool.read_tokens(lease.device_indices)
            bitwise &= torch.equal(got, payload(as_key_bytes(seq[: lease.cached_len])))
            cache.release(lease)
            await cache.wait_idle()
        cache.sanity_check()
    return {"prefetch": counts, "prefill_tokens_saved": saved, "kv_bitwise": bitwise}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="one tiny pass (seconds): the same JSON keys, no figure worth reading",
    )
    args = parser.parse_args()
    if args.smoke:
        args.requests = 2
    t = time.perf_counter()
    result: dict[str, object] = {"bench": "refill", "requests": args.requests, "tokens_per_request": 2 * HALF}
    for policy in ("drop", "backup_then_attach"):
        result[policy] = await run(policy, args.requests)
    result["seconds"] = round(time.perf_counter() - t, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    anyio.run(main)
