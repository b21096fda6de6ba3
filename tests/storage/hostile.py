"""Hostile storage: pages that verify but are not the reader's, run on every backend.

A mixin for the backend test classes of `contract.py`; a subclass provides the contract's `reopen` hook and a
`raw_store` fixture: a `RawStore` that reads and writes stored objects (header and payload) by page key,
bypassing the backend, as a careless operator or another program would (`cp`, `mv`, an S3 copy).

Every case must be a miss counted by its reason, never a loaded page: a valid page copied over another key,
a page of another namespace under the right key, pages of caches that differ in layout, dtype, model id,
tensor-parallel rank or a component's layout (each a real `HiCacheConfig`'s namespace), old-format
(version 1) pages, a valid page with bytes appended, and a well-formed page of another length. The file backend adds symlinks in `test_file_backend.py`.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Protocol

import pytest
import torch
import xxhash
from contract import Reopen, empty_pages, make_keys, make_pages

from hicache import HiCacheConfig, KVLayout, Namespace, SlidingWindow
from storage_backends.protocol import PageStatus, StorageBackend

__all__ = ["VARIANTS", "HostileStorage", "RawStore", "base_config", "v1_page"]

_SENTINEL = 0x5A

_LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float16, page_size=4)
_SWA = SlidingWindow(8, KVLayout.flat(8, 4), device_pages=4, host_pages=4)


def base_config(**overrides: object) -> HiCacheConfig:
    """The reader's cache: 2 layers x 2 heads x 16 float16, 4-token pages (512-byte pages)."""
    options: dict[str, object] = {
        "layout": _LAYOUT,
        "device_pages": 4,
        "host_pages": 4,
        "namespace": Namespace(model_id="model@rev1"),
    }
    options.update(overrides)
    return HiCacheConfig(**options)  # type: ignore[arg-type]


def _layout(**fields: object) -> KVLayout:
    return dataclasses.replace(_LAYOUT, **fields)  # type: ignore[arg-type]


VARIANTS: dict[str, HiCacheConfig] = {
    "layout_4x1_heads": base_config(layout=_layout(num_kv_heads=4, head_dim=8)),  # same page bytes
    "layout_layers": base_config(layout=_layout(num_layers=4)),
    "dtype_bfloat16": base_config(layout=_layout(dtype=torch.bfloat16)),  # same page bytes
    "dtype_float32": base_config(layout=_layout(dtype=torch.float32)),
    "page_size": base_config(layout=_layout(page_size=8)),
    "model_id": base_config(namespace=Namespace(model_id="model@rev2")),
    "tp_rank": base_config(namespace=Namespace(model_id="model@rev1", tp_rank=1, tp_size=2)),
    "component_layout": base_config(components=(_SWA,)),
}
"""Writers that differ from `base_config()` in one namespace field each."""


class RawStore(Protocol):
    """Stored objects by page key, bypassing the backend (header and payload as stored)."""

    async def read(self, key: str) -> bytes:
        """The stored object of `key`."""
        ...

    async def write(self, key: str, data: bytes) -> None:
        """Store `data` as the object of `key`, replacing any."""
        ...


def v1_page(payload: bytes, namespace_digest: bytes) -> bytes:
    """A page as format version 1 wrote it: a 40-byte header (no key digest) and the payload."""
    header = struct.pack(
        "<4sBBH16sQQ", b"HKVP", 1, 0, 0, namespace_digest, len(payload), xxhash.xxh3_64_intdigest(payload)
    )
    return header + payload


def _stats(backend: StorageBackend) -> tuple[int, int, int, int]:
    """(pages read, foreign pages, old-format pages, checksum failures) from the backend's statistics."""
    s = backend.statistics()  # type: ignore[attr-defined]
    return (s.pages_read, s.foreign_pages, s.old_format_pages, s.checksum_failures)


class HostileStorage:
    """Hostile-storage tests; subclasses provide `reopen` (contract hook) and `raw_store`."""

    @pytest.fixture
    def raw_store(self) -> RawStore:
        """Hook: raw object access to the store that `reopen` opens."""
        raise NotImplementedError

    async def _read(
        self, reopen: Reopen, keys: list[str], page_bytes: int, digest: bytes | None = None
    ) -> tuple[list[PageStatus], list[memoryview], tuple[int, int, int, int]]:
        """Read `keys` as the base cache (or `digest`'s) would, into sentinel-filled buffers."""
        reader = await reopen(digest if digest is not None else base_config().namespace.digest)
        try:
            out = empty_pages(len(keys), page_bytes, fill=_SENTINEL)
            statuses = await reader.get(keys, out)
            return statuses, out, _stats(reader)
        finally:
            await reader.aclose()

    async def _write(self, reopen: Reopen, digest: bytes, keys: list[str], pages: list[memoryview]) -> None:
        writer = await reopen(digest)
        try:
            assert await writer.put(keys, pages) == [True] * len(keys)
        finally:
            await writer.aclose()

    async def test_valid_page_copied_over_another_key_is_foreign(
        self, reopen: Reopen, raw_store: RawStore
    ) -> None:
        """A verified page copied over another stored key, or over a key never written, loads as neither."""
        ns = base_config().namespace.digest
        size = base_config().layout.page_nbytes
        keys, pages = make_keys(3, salt=1), make_pages(3, size, seed=1)
        await self._write(reopen, ns, keys[:2], pages[:2])
        body = await raw_store.read(keys[0])
        await raw_store.write(keys[1], body)  # over a stored page
        await raw_store.write(keys[2], body)  # over a key never written
        statuses, out, (read, foreign, _, _) = await self._read(reopen, keys, size)
        assert statuses == [PageStatus.HIT, PageStatus.FOREIGN, PageStatus.FOREIGN]
        assert bytes(out[0]) == bytes(pages[0])
        assert (read, foreign) == (1, 2)

    async def test_page_of_another_namespace_under_the_right_key_is_foreign(
        self, reopen: Reopen, raw_store: RawStore
    ) -> None:
        """Another cache's valid page placed under this cache's key (its object renamed there) is a miss."""
        size = base_config().layout.page_nbytes
        ours, theirs = make_keys(1, salt=2), make_keys(1, salt=3)
        pages = make_pages(1, size, seed=2)
        await self._write(reopen, VARIANTS["model_id"].namespace.digest, theirs, pages)
        await raw_store.write(ours[0], await raw_store.read(theirs[0]))
        statuses, _, (read, foreign, _, _) = await self._read(reopen, ours + theirs, size)
        assert statuses == [PageStatus.FOREIGN, PageStatus.FOREIGN]
        assert (read, foreign) == (0, 2)

    @pytest.mark.parametrize("variant", list(VARIANTS))
    async def test_pages_of_a_differently_configured_cache_are_foreign(
        self, reopen: Reopen, variant: str
    ) -> None:
        """A writer differing in layout, dtype, page size, model id, TP rank or component layout puts pages
        of its own size under the reader's keys: each is a foreign miss, never a buffer-size error."""
        writer = VARIANTS[variant]
        size = base_config().layout.page_nbytes
        keys = make_keys(2, salt=4)
        await self._write(
            reopen, writer.namespace.digest, keys, make_pages(2, writer.layout.page_nbytes, seed=3)
        )
        statuses, _, (read, foreign, _, _) = await self._read(reopen, keys, size)
        assert statuses == [PageStatus.FOREIGN] * 2
        assert (read, foreign) == (0, 2)
        # The writer itself reads them back: only the namespace separates the two.
        mine, _, (read, foreign, _, _) = await self._read(
            reopen, keys, writer.layout.page_nbytes, writer.namespace.digest
        )
        assert mine == [PageStatus.HIT] * 2
        assert (read, foreign) == (2, 0)

    @pytest.mark.parametrize("shape", ["same_payload", "same_object_size"])
    async def test_old_format_pages_are_misses(self, reopen: Reopen, raw_store: RawStore, shape: str) -> None:
        """Version 1 pages (no key in the header) are misses counted as old_format, never loaded or raised,
        whether their payload or their whole object has the size the reader expects."""
        ns = base_config().namespace.digest
        size = base_config().layout.page_nbytes
        keys = make_keys(2, salt=5)
        payload_size = size if shape == "same_payload" else size + 16  # v2's header is 16 bytes longer
        for key, page in zip(keys, make_pages(2, payload_size, seed=4), strict=True):
            await raw_store.write(key, v1_page(bytes(page), ns))
        statuses, _, (read, _, old, _) = await self._read(reopen, keys, size)
        assert statuses == [PageStatus.OLD_FORMAT] * 2
        assert (read, old) == (0, 2)

    async def test_bytes_appended_after_a_valid_page_are_corrupt(
        self, reopen: Reopen, raw_store: RawStore
    ) -> None:
        """A valid page with bytes appended (a botched copy or append) is a corrupt miss, never loaded, though
        its header and payload checksum still verify: every backend checks the stored size."""
        ns = base_config().namespace.digest
        size = base_config().layout.page_nbytes
        keys, pages = make_keys(2, salt=8), make_pages(2, size, seed=9)
        await self._write(reopen, ns, keys, pages)
        await raw_store.write(keys[0], await raw_store.read(keys[0]) + b"\x00")
        statuses, out, (read, foreign, old, corrupt) = await self._read(reopen, keys, size)
        assert statuses == [PageStatus.CORRUPT, PageStatus.HIT]
        assert bytes(out[1]) == bytes(pages[1])
        assert (read, foreign, old, corrupt) == (1, 0, 0, 1)

    @pytest.mark.parametrize("delta", [1, -1, 512], ids=["one_byte_longer", "one_byte_shorter", "double"])
    async def test_a_well_formed_page_of_another_length_is_corrupt(
        self, reopen: Reopen, raw_store: RawStore, delta: int
    ) -> None:
        """A page with the right namespace, key and checksum whose payload is `delta` bytes off the reader's
        page size raised ValueError from `get`: the whole batch was lost, nothing counted, and the object
        stayed for good (issue 22, item 10). The namespace binds the page bytes, so such a page is damaged,
        not a wrong buffer: a counted `CORRUPT` miss, never loaded, and the rest of the batch loads."""
        ns = base_config().namespace.digest
        size = base_config().layout.page_nbytes
        keys, pages = make_keys(3, salt=10), make_pages(3, size, seed=11)
        await self._write(reopen, ns, keys, pages)
        # A well-formed page of another length under keys[1]: written as that size's writer would.
        await self._write(reopen, ns, keys[1:2], make_pages(1, size + delta, seed=12))
        statuses, out, (read, foreign, old, corrupt) = await self._read(reopen, keys, size)
        assert statuses == [PageStatus.HIT, PageStatus.CORRUPT, PageStatus.HIT]
        assert (bytes(out[0]), bytes(out[2])) == (bytes(pages[0]), bytes(pages[2]))
        assert (read, foreign, old, corrupt) == (2, 0, 0, 1)

    async def test_a_mix_of_every_case_loads_only_the_readers_own_pages(
        self, reopen: Reopen, raw_store: RawStore
    ) -> None:
        """One batch mixing every hostile case with good pages: the good ones load bitwise, the rest are
        counted by reason and never reported loaded."""
        ns = base_config().namespace.digest
        size = base_config().layout.page_nbytes
        keys, pages = make_keys(6, salt=6), make_pages(6, size, seed=5)
        await self._write(reopen, ns, [keys[0], keys[1], keys[5]], [pages[0], pages[1], pages[5]])
        await raw_store.write(keys[1], await raw_store.read(keys[0]))  # a copy over another key
        await self._write(reopen, VARIANTS["tp_rank"].namespace.digest, [keys[2]], [pages[2]])
        await raw_store.write(keys[3], v1_page(bytes(pages[3]), ns))
        statuses, out, (read, foreign, old, _) = await self._read(reopen, keys, size)
        assert statuses == [
            PageStatus.HIT,
            PageStatus.FOREIGN,
            PageStatus.FOREIGN,
            PageStatus.OLD_FORMAT,
            PageStatus.MISS,
            PageStatus.HIT,
        ]
        assert (bytes(out[0]), bytes(out[5])) == (bytes(pages[0]), bytes(pages[5]))
        assert (read, foreign, old) == (2, 2, 1)
