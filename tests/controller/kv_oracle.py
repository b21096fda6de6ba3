"""A KV-content oracle, exact pool accounting and a fault-injecting backend for controller tests.

The oracle's KV depends on the whole prefix, not only on a token: every token's values encode 16 bits of
the chained hash of its page and its offset in the page. A page attached under the wrong parent, a host
page swapped with another, or a stale buffer therefore never matches, even when the tokens are equal.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import anyio
import anyio.lowlevel
import torch
import xxhash
from cache_internals import host_pool_of, release_queue_of, tree_of
from controller_helpers import PassThroughBackend

from hicache import HiCache, KVLayout
from hicache.errors import StorageError
from hicache.keys import ROOT_HASH, TOKEN_BYTES, Namespace, chained_page_hashes
from hicache.tree import NodeRef, RadixTree
from storage_backends.protocol import PageStatus, StorageBackend

__all__ = [
    "FaultyBackend",
    "chain_payload",
    "check_leased_kv",
    "check_pools_exact",
    "check_tree_kv",
    "layout_for",
    "page_bytes",
    "page_keys",
    "path_key",
    "read_tokens_kv",
    "store_chain",
    "v1_page",
]


def layout_for(page_size: int) -> KVLayout:
    """The small test layout (2 layers, 1 head of dim 4, float32) with `page_size` tokens per page."""
    return KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32, page_size=page_size)


def chain_payload(key: bytes, layout: KVLayout, namespace: Namespace) -> torch.Tensor:
    """Deterministic KV for the page-aligned `key` (from the root), shaped for `KVPool.write_tokens`.

    value = ((hash16(page) * 16 + offset in page) * 16 + layer * 8 + plane * 4 + dim); below 2**24, so
    exact in float32.
    """
    page = layout.page_size
    n = len(key) // TOKEN_BYTES
    assert n % page == 0, f"key of {n} tokens is not page-aligned (page size {page})"
    assert layout.num_layers <= 2
    assert layout.head_dim <= 4
    assert page <= 16
    hashes = chained_page_hashes(key, page, namespace, ROOT_HASH)
    tags = torch.tensor([int.from_bytes(h[:2], "little") for h in hashes], dtype=torch.int64)
    base = (tags.repeat_interleave(page) * 16 + torch.arange(n) % page).to(torch.float32)
    layer = torch.arange(layout.num_layers, dtype=torch.float32).view(-1, 1, 1, 1, 1)
    plane = torch.arange(2, dtype=torch.float32).view(1, 2, 1, 1, 1)
    dim = torch.arange(layout.head_dim, dtype=torch.float32).view(1, 1, 1, 1, -1)
    return (
        (base.view(1, 1, n, 1, 1) * 16 + layer * 8 + plane * 4 + dim)
        .expand(layout.num_layers, 2, n, layout.num_kv_heads, layout.head_dim)
        .contiguous()
    )


def page_bytes(key: bytes, layout: KVLayout, namespace: Namespace) -> list[bytes]:
    """The stored payload of each page of the aligned `key`, page-first as the host pool holds it."""
    data = chain_payload(key, layout, namespace)
    page = layout.page_size
    n_pages = data.shape[2] // page
    pages = data.view(layout.num_layers, 2, n_pages, page, layout.num_kv_heads, layout.head_dim)
    return [pages[:, :, i].contiguous().numpy().tobytes() for i in range(n_pages)]


def page_keys(key: bytes, layout: KVLayout, namespace: Namespace) -> list[str]:
    """Storage keys of the pages of `key` (hex chained hashes)."""
    return [h.hex() for h in chained_page_hashes(key, layout.page_size, namespace, ROOT_HASH)]


async def store_chain(
    backend: StorageBackend, key: bytes, layout: KVLayout, namespace: Namespace
) -> list[str]:
    """Put the pages of the aligned `key` into `backend` as another instance would; returns their keys."""
    keys = page_keys(key, layout, namespace)
    views = [memoryview(bytearray(b)) for b in page_bytes(key, layout, namespace)]
    ok = await backend.put(keys, views)
    assert all(ok), ok
    return keys


def v1_page(payload: bytes, namespace_digest: bytes) -> bytes:
    """A stored page as page format version 1 wrote it (a 40-byte header without the key digest)."""
    header = struct.pack(
        "<4sBBH16sQQ", b"HKVP", 1, 0, 0, namespace_digest, len(payload), xxhash.xxh3_64_intdigest(payload)
    )
    return header + payload


def path_key(tree: RadixTree, node: NodeRef) -> bytes:
    """The key from the root to the end of `node` (asked of the tree, node by node)."""
    parts: list[bytes] = []
    current: NodeRef | None = node
    while current is not None:
        info = tree.node_info(current)
        parts.append(info.key)
        current = info.parent
    return b"".join(reversed(parts))


def read_tokens_kv(cache: HiCache, indices: torch.Tensor, *, host: bool = False) -> torch.Tensor:
    """The KV held at `indices` of the device (or host) pool."""
    pool = host_pool_of(cache) if host else cache.device_pool
    return pool.read_tokens(indices)


def check_tree_kv(cache: HiCache) -> int:
    """Every node's device and committed host pages hold the oracle KV of its path; returns tokens
    checked."""
    layout, ns = cache.config.layout, cache.config.namespace
    memo: dict[bytes, torch.Tensor] = {}
    checked = 0
    tree = tree_of(cache)
    for node in tree.iter_nodes():
        info = tree.node_info(node)
        if info.device_value is None and info.host_value is None:
            continue
        full = path_key(tree, node)
        expected_all = memo.get(full)
        if expected_all is None:
            expected_all = memo[full] = chain_payload(full, layout, ns)
        n = info.num_tokens
        expected = expected_all[:, :, -n:]
        for host, value in ((False, info.device_value), (True, info.host_value)):
            if value is None:
                continue
            got = read_tokens_kv(cache, value, host=host)
            tier = "host" if host else "device"
            assert torch.equal(got, expected), f"{tier} KV of {info!r} differs from its path's payload"
            checked += n
    return checked


def check_leased_kv(cache: HiCache, key: bytes, device_indices: torch.Tensor) -> None:
    """A lease's device pages hold the oracle KV of the first `len(device_indices)` tokens of `key`."""
    n = int(device_indices.numel())
    if n == 0:
        return
    expected = chain_payload(key[: n * TOKEN_BYTES], cache.config.layout, cache.config.namespace)
    assert torch.equal(read_tokens_kv(cache, device_indices), expected), "leased device KV is wrong"


def _assert_owned_once(
    name: str, owned: Sequence[torch.Tensor], used_pages: int, page_size: int, is_free: object
) -> None:
    parts = [t for t in owned if t.numel()]
    flat = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
    values = flat.tolist()
    assert len(set(values)) == len(values), f"{name}: an index is owned twice"
    pages = {v // page_size for v in values}
    assert len(pages) * page_size == len(values), f"{name}: partial pages owned"
    assert len(pages) == used_pages, f"{name}: {len(pages)} pages owned, {used_pages} used"
    assert callable(is_free)
    free_owned = [p for p in pages if is_free(p)]
    assert not free_owned, f"{name}: pages {free_owned[:5]} are owned but free"


def check_pools_exact(
    cache: HiCache,
    *,
    held_device: Sequence[torch.Tensor] = (),
    prefetch_host: Sequence[torch.Tensor] = (),
) -> None:
    """Index-level accounting (call with the release queue drained): every used page has one owner.

    Device owners: the tree and `held_device` (the test's allocated, not inserted pages). Host owners:
    the tree (pending backups included), `prefetch_host` (host pages of prefetches in flight) and the
    release queue's quarantine (pages a stray storage thread may still write into).
    """
    assert release_queue_of(cache).statistics().pending_calls == 0, "drain the release queue first"
    page = cache.page_size
    _assert_owned_once(
        "device pool",
        [tree_of(cache).device_tokens_owned(), *held_device],
        cache.device_pool.statistics().used_pages,
        page,
        cache.device_pool.allocator.is_free,
    )
    _assert_owned_once(
        "host pool",
        [
            tree_of(cache).host_tokens_owned(),
            *prefetch_host,
            *release_queue_of(cache).quarantined_host_indices(),
        ],
        host_pool_of(cache).statistics().used_pages,
        page,
        host_pool_of(cache).allocator.is_free,
    )


class FaultyBackend(PassThroughBackend):
    """Wraps a backend: gates page reads, and fails, hangs or lies about chosen pages.

    Faults are set per page key in `faults`:
      * ``"error"``: a `get` whose batch contains the page raises `StorageError`;
      * ``"false"``: the page is reported unread (`PageStatus.MISS`), its buffer untouched;
      * ``"hang"``: the read of the page waits until cancelled (a storage timeout).
    `exists_error` makes `exists` raise. When `gated`, each page read waits for a credit from `allow()`.
    The wrapper counts reads started and finished so a test can check none is left in flight.
    """

    def __init__(self, inner: StorageBackend, *, gated: bool = False) -> None:
        super().__init__(inner)
        self.gated = gated
        self.faults: dict[str, str] = {}
        self.exists_error = False
        self.reads_started = 0
        self.reads_done = 0
        self.errors_raised = 0
        self._credits = 0
        self._changed = anyio.Event()

    @property
    def credits(self) -> int:
        """Gated page reads allowed and not yet started."""
        return self._credits

    def allow(self, pages: int = 1) -> None:
        """Let `pages` more page reads proceed (when gated)."""
        self._credits += pages
        self._changed.set()
        self._changed = anyio.Event()

    def open_gate(self) -> None:
        """Stop gating: every read proceeds."""
        self.gated = False
        self.allow(0)

    async def exists(self, keys: Sequence[str]) -> int:
        if self.exists_error:
            self.errors_raised += 1
            raise StorageError("injected: exists failed")
        return await self.inner.exists(keys)

    async def get(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[PageStatus]:
        if any(self.faults.get(k) == "error" for k in keys):
            self.errors_raised += 1
            raise StorageError("injected: get failed")
        results: list[PageStatus] = []
        for key, buf in zip(keys, buffers, strict=True):
            while self.gated and self._credits == 0:
                await self._changed.wait()
            if self.gated:
                self._credits -= 1
            self.reads_started += 1
            try:
                fault = self.faults.get(key)
                if fault == "hang":
                    await anyio.sleep_forever()
                if fault == "false":
                    results.append(PageStatus.MISS)
                else:
                    results.extend(await self.inner.get([key], [buf]))
            finally:
                self.reads_done += 1
        return results
