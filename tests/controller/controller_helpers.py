"""Helpers for controller tests: small configurations, a gated backend, stored sequences, a loop clock."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import anyio
import pytest
import torch

from hicache import HiCache, HiCacheConfig, KVLayout, Namespace
from hicache.keys import ROOT_HASH, as_key_bytes, chained_page_hashes
from storage_backends.memory import MemoryBackend
from storage_backends.protocol import PageStatus, StorageBackend

PAGE = 4
LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32, page_size=PAGE)


HOUR_S = 3600.0
"""How long a hung call hangs on a `LoopClock`: past every deadline a test sets."""


class LoopClock:
    """The running event loop's clock, made to jump: deadlines (`anyio.move_on_after`, which the cache's
    lookup, read and stop-policy budgets use) fire when the test says the time passed, never because real
    time did.

    It runs at real speed otherwise, so the budgets can be long (real work never races them) while a
    hang is cut at the loop's next turn.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        loop = asyncio.get_running_loop()
        real_time = loop.time
        self.offset = 0.0
        monkeypatch.setattr(loop, "time", lambda: real_time() + self.offset)

    def advance(self, seconds: float) -> None:
        """Let `seconds` pass: every deadline due by then fires at the loop's next turn."""
        self.offset += seconds


def make_config(**overrides: object) -> HiCacheConfig:
    """A small cache: 4-token pages of 128 bytes, 32 device pages, 64 host pages, threshold 8 tokens."""
    options: dict[str, object] = {
        "layout": LAYOUT,
        "device_pages": 32,
        "host_pages": 64,
        "prefetch_threshold": 8,
        "storage_batch_pages": 2,
        "storage_concurrency": 1,  # gated tests count pages batch by batch
        "namespace": Namespace(model_id="controller-tests"),
    }
    options.update(overrides)
    return HiCacheConfig(**options)  # type: ignore[arg-type]


def tokens(start: int, n: int) -> list[int]:
    """n consecutive token ids from `start`."""
    return list(range(start, start + n))


def page_payload(key: bytes, layout: KVLayout = LAYOUT) -> torch.Tensor:
    """Deterministic KV for `key`'s tokens, shaped for `KVPool.write_tokens`."""
    ids = torch.frombuffer(bytearray(key), dtype=torch.int64).to(torch.float32)
    n = ids.numel()
    base = ids.view(1, 1, n, 1, 1)
    layer = torch.arange(layout.num_layers, dtype=torch.float32).view(-1, 1, 1, 1, 1)
    plane = torch.arange(2, dtype=torch.float32).view(1, 2, 1, 1, 1)
    dim = torch.arange(layout.head_dim, dtype=torch.float32).view(1, 1, 1, 1, -1)
    return (
        (base * 1000 + layer * 100 + plane * 10 + dim)
        .expand(layout.num_layers, 2, n, layout.num_kv_heads, layout.head_dim)
        .contiguous()
    )


async def store_sequence(
    backend: MemoryBackend, cache: HiCache, seq: Sequence[int], layout: KVLayout = LAYOUT
) -> list[str]:
    """Put the pages of `seq` (with `page_payload` data for `layout`) into `backend` as another instance
    would."""
    key = as_key_bytes(list(seq))
    hashes = chained_page_hashes(key, PAGE, cache.config.namespace, ROOT_HASH)
    keys = [h.hex() for h in hashes]
    data = page_payload(key[: len(hashes) * PAGE * 8], layout)
    # one page at a time, page-first: (pages, layers, 2, page, heads, dim)
    pages = data.view(layout.num_layers, 2, len(hashes), PAGE, 1, layout.head_dim).permute(2, 0, 1, 3, 4, 5)
    views = [memoryview(pages[i].contiguous().numpy().tobytes()) for i in range(len(hashes))]
    ok = await backend.put(keys, views)
    assert all(ok)
    return keys


async def prefetch_together(cache: HiCache, seqs: Sequence[Sequence[int]]) -> list[str]:
    """Start a prefetch of each of `seqs` (request ids `r0`, `r1`, ...) in one loop iteration; the ids of
    those admitted, in the order their `prefetch` returned."""
    admitted: list[str] = []

    async def start(i: int) -> None:
        if await cache.prefetch(f"r{i}", seqs[i]) is not None:
            admitted.append(f"r{i}")

    async with anyio.create_task_group() as tg:
        for i in range(len(seqs)):
            tg.start_soon(start, i)
    return admitted


async def insert_device_chain(cache: HiCache, seq: Sequence[int], *, schedule_backups: bool = True) -> None:
    """Serve `seq` as a request would: acquire, allocate, write KV, insert."""
    lease = await cache.acquire(f"fill-{seq[0]}-{len(seq)}", seq)
    n = len(seq)
    padded = -(-n // PAGE) * PAGE
    new = await cache.alloc_device(padded - lease.cached_len)
    assert new is not None
    indices = torch.cat([lease.device_indices, new])
    key = as_key_bytes(list(seq))
    cache.device_pool.write_tokens(new[: n - lease.cached_len], page_payload(key[lease.cached_len * 8 :]))
    await cache.insert(lease, seq, indices)


class PassThroughBackend:
    """A storage wrapper that forwards every call to `inner`; test backends override what they change."""

    def __init__(self, inner: StorageBackend) -> None:
        self.inner = inner

    async def exists(self, keys: Sequence[str]) -> int:
        return await self.inner.exists(keys)

    async def get(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[PageStatus]:
        return await self.inner.get(keys, buffers)

    async def put(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[bool]:
        return await self.inner.put(keys, buffers)

    async def delete(self, keys: Sequence[str]) -> None:
        await self.inner.delete(keys)

    async def aclose(self) -> None:
        await self.inner.aclose()


class GatedBackend(PassThroughBackend):
    """A memory backend whose `get` reads one page per `allow()`; everything else passes through.

    Lets a test hold a prefetch mid-stream at an exact page, with no sleeps.
    """

    def __init__(self, inner: MemoryBackend) -> None:
        super().__init__(inner)
        self._credits = 0
        self._changed = anyio.Event()
        self.reads_started = 0
        self.reads_done = 0
        self.exists_gate: anyio.Event | None = None

    def allow(self, pages: int = 1) -> None:
        """Let `pages` more page reads proceed."""
        self._credits += pages
        self._changed.set()
        self._changed = anyio.Event()

    async def exists(self, keys: Sequence[str]) -> int:
        if self.exists_gate is not None:
            await self.exists_gate.wait()
        return await self.inner.exists(keys)

    async def get(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[PageStatus]:
        results: list[PageStatus] = []
        for key, buf in zip(keys, buffers, strict=True):
            while self._credits == 0:
                await self._changed.wait()
            self._credits -= 1
            self.reads_started += 1
            try:
                results.extend(await self.inner.get([key], [buf]))
            finally:
                self.reads_done += 1
        return results
