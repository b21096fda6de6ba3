"""A storage backend of your own: implement the five methods of `StorageBackend` and hand it to `HiCache`.

The first cache writes its pages through to the backend; a second, fresh cache (a restarted server) finds
them there and prefetches them instead of recomputing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import torch

from hicache import CacheClosed, HiCache, HiCacheConfig, KVLayout
from storage_backends.protocol import StorageBackend


class DictBackend:
    """Pages as `bytes` in a dict. Real backends would also verify a checksum on `get`."""

    def __init__(self) -> None:
        self.pages: dict[str, bytes] = {}
        self.closed = False

    def _check(self) -> None:
        if self.closed:
            raise CacheClosed("DictBackend is closed")

    async def exists(self, keys: Sequence[str]) -> int:
        self._check()
        count = 0
        while count < len(keys) and keys[count] in self.pages:
            count += 1
        return count

    async def get(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[bool]:
        self._check()
        ok = []
        for key, buf in zip(keys, buffers, strict=True):
            data = self.pages.get(key)
            if data is not None and len(data) == buf.nbytes:
                buf.cast("B")[:] = data
            ok.append(data is not None and len(data) == buf.nbytes)
        return ok

    async def put(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[bool]:
        self._check()
        for key, buf in zip(keys, buffers, strict=True):
            self.pages[key] = bytes(buf)  # one assignment: readers see the whole page or none
        return [True] * len(keys)

    async def delete(self, keys: Sequence[str]) -> None:
        self._check()
        for key in keys:
            self.pages.pop(key, None)

    async def aclose(self) -> None:
        self.closed = True


LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32, page_size=4)
CONFIG = HiCacheConfig(layout=LAYOUT, device_pages=16, host_pages=32, prefetch_threshold=8)


async def serve(cache: HiCache, tokens: torch.Tensor) -> dict[str, int]:
    lease = await cache.acquire("req", tokens)
    kv = tokens.float().view(1, 1, -1, 1, 1).expand(*LAYOUT.tokens_shape(tokens.numel())).clone()
    assert torch.equal(cache.device_pool.read_tokens(lease.device_indices), kv[:, :, : lease.cached_len])
    new = tokens.numel() - lease.cached_len
    indices = await cache.alloc_device(-(-new // LAYOUT.page_size) * LAYOUT.page_size)
    assert indices is not None
    cache.device_pool.write_tokens(indices[:new], kv[:, :, lease.cached_len :])
    await cache.insert(lease, tokens, torch.cat([lease.device_indices, indices]))
    return lease.hit_tokens_by_tier


async def main() -> None:
    backend = DictBackend()
    assert isinstance(backend, StorageBackend)  # the protocol is runtime-checkable
    tokens = torch.arange(1000, 1034)
    async with HiCache(CONFIG, storage=backend) as cache:  # the caller keeps ownership of `backend`
        print("first server: ", await serve(cache, tokens))
        await cache.wait_idle()  # backups to host, then write-through to storage
    print(f"backend holds {len(backend.pages)} pages")
    async with HiCache(CONFIG, storage=backend) as cache:
        print("second server:", await serve(cache, tokens))
    await backend.aclose()


if __name__ == "__main__":
    asyncio.run(main())
