"""A storage backend of your own: implement the five methods of `StorageBackend` and hand it to `HiCache`.

The first cache writes its pages through to the backend; a second, fresh cache (a restarted server) finds
them there and prefetches them instead of recomputing. Every page is stored behind a `page_format` header
that binds it to the cache's namespace and to its key, and `get` reports a `PageStatus` per page: a page
copied over another key, or written by another model, is never loaded.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import torch

from hicache import CacheClosed, HiCache, HiCacheConfig, KVLayout, Namespace
from hicache.errors import ChecksumMismatch
from storage_backends.page_format import HEADER_SIZE, encode_header, failure_status, verify_page
from storage_backends.protocol import PageStatus, StorageBackend


class DictBackend:
    """Pages (header + payload) as `bytes` in a dict, verified on every `get`."""

    def __init__(self, namespace_digest: bytes) -> None:
        self.namespace_digest = namespace_digest
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

    async def get(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[PageStatus]:
        # Verification hashes the payload: a backend with large pages does this in a worker thread.
        self._check()
        out = []
        for key, buf in zip(keys, buffers, strict=True):
            data = self.pages.get(key)
            if data is None:
                out.append(PageStatus.MISS)
                continue
            if len(data) != HEADER_SIZE + buf.nbytes:
                out.append(PageStatus.CORRUPT)
                continue
            stored = memoryview(data)
            try:  # magic, version, namespace, key, length, checksum
                verify_page(stored[:HEADER_SIZE], stored[HEADER_SIZE:], self.namespace_digest, key)
            except ChecksumMismatch as exc:
                out.append(failure_status(exc))  # FOREIGN, OLD_FORMAT or CORRUPT
                continue
            buf.cast("B")[:] = stored[HEADER_SIZE:]
            out.append(PageStatus.HIT)
        return out

    async def put(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[bool]:
        self._check()
        for key, buf in zip(keys, buffers, strict=True):
            # One assignment: readers see the whole page or none.
            self.pages[key] = encode_header(buf, self.namespace_digest, key) + bytes(buf)
        return [True] * len(keys)

    async def delete(self, keys: Sequence[str]) -> None:
        self._check()
        for key in keys:
            self.pages.pop(key, None)

    async def aclose(self) -> None:
        self.closed = True


LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32, page_size=4)
CONFIG = HiCacheConfig(
    layout=LAYOUT,
    device_pages=16,
    host_pages=32,
    prefetch_threshold=8,
    namespace=Namespace(model_id="example-model@rev1"),
)


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
    backend = DictBackend(CONFIG.namespace.digest)
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
