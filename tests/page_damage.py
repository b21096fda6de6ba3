"""Damage one stored page of a `FileBackend` and no other (tests only).

A page's name is a hard link to the group file its put wrote (docs/storage.md, "Group files"), so writing
or truncating that file in place damages every page of the group, and its table. These helpers damage one
page's bytes only, found through `FileBackend.page_extent`:

- `flip_page_byte`: flip one bit of the page's header or payload, in place (the group's other pages and its
  table are untouched; their names share the file and still verify).
- `rewrite_page`: give the page's name a file of its own (a group of one) holding `transform(page bytes)`,
  the table naming the page at offset 0: a truncated, overlong or replaced page, as a torn write of that one
  page would leave it. The name is unlinked first, so the old group file is never written.
- `page_bytes`: the page's header and payload as stored.

Each takes a `FileBackend`, or `pages_at(root, namespace_digest)` for a root no backend has open (a
copy of another process's store).
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from storage_backends import native
from storage_backends.file_pages import GROUP_ENTRY, GROUP_FOOTER, GROUP_MAGIC, GROUP_VERSION, PageFiles
from storage_backends.page_format import HEADER_SIZE, key_digest

__all__ = ["Pages", "damage_page", "flip_page_byte", "group_file", "page_bytes", "pages_at", "rewrite_page"]


class Pages(Protocol):
    """What the helpers need of a store: a page's name and its extent (`FileBackend` has both)."""

    def path_of(self, key: str) -> Path: ...
    def page_extent(self, key: str) -> tuple[Path, int, int]: ...


class _Root:
    def __init__(self, root: Path, namespace_digest: bytes) -> None:
        self._files = PageFiles(str(root), namespace_digest, durable=False, read_flags=0)

    def path_of(self, key: str) -> Path:
        return Path(self._files.path(key))

    def page_extent(self, key: str) -> tuple[Path, int, int]:
        path, offset, length = self._files.extent(key)
        return Path(path), offset, length


def pages_at(root: Path, namespace_digest: bytes) -> Pages:
    """The pages under `root`, as a `FileBackend` there would name them (no backend opened)."""
    return _Root(root, namespace_digest)


def page_bytes(backend: Pages, key: str) -> bytes:
    """The header and payload of page `key` as stored."""
    path, offset, length = backend.page_extent(key)
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


def group_file(pages: list[tuple[bytes, bytes]]) -> bytes:
    """The bytes of a group file holding `pages` ((key digest, header + payload) each) as the writer lays
    it out: the pages end to end, the table, the footer."""
    body = b"".join(data for _, data in pages)
    offsets, pos = [], 0
    for _, data in pages:
        offsets.append(pos)
        pos += len(data)
    table = b"".join(GROUP_ENTRY.pack(d, o) for (d, _), o in zip(pages, offsets, strict=True))
    return body + table + GROUP_FOOTER.pack(GROUP_MAGIC, GROUP_VERSION, len(pages), native.xxh3_64(table))


def rewrite_page(backend: Pages, key: str, transform: Callable[[bytes], bytes]) -> None:
    """Replace page `key`'s name by a group file of its own holding `transform(page bytes)`."""
    data = transform(page_bytes(backend, key))
    path = backend.path_of(key)
    path.unlink()
    path.write_bytes(group_file([(key_digest(key), data)]))


def flip_page_byte(backend: Pages, key: str, offset: int) -> None:
    """Flip the low bit of byte `offset` of page `key` (0: the header's first), in its group file."""
    path, base, length = backend.page_extent(key)
    assert 0 <= offset < length, (offset, length)
    fd = os.open(path, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, base + offset)
        os.pwrite(fd, bytes([byte[0] ^ 0x01]), base + offset)
    finally:
        os.close(fd)


def damage_page(backend: Pages, key: str, how: str, rng: random.Random) -> None:
    """Really damage page `key` alone: `truncate` it, `flip_payload` or `flip_header` a byte, or make it
    `missing`."""
    if how == "missing":
        Path(backend.path_of(key)).unlink()
        return
    _, _, length = backend.page_extent(key)
    if how == "truncate":
        cut = rng.randrange(0, length)
        rewrite_page(backend, key, lambda data: data[:cut])
        return
    offset = rng.randrange(HEADER_SIZE, length) if how == "flip_payload" else rng.randrange(0, HEADER_SIZE)
    path, base, _ = backend.page_extent(key)
    fd = os.open(path, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, base + offset)
        os.pwrite(fd, bytes([byte[0] ^ (1 << rng.randrange(8))]), base + offset)
    finally:
        os.close(fd)
