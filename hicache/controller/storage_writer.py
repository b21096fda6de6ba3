"""Host -> storage write-through: after a host backup commits, its pages go to storage in the background."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from hicache.components import component_storage_key
from hicache.tree import TreeNode
from storage_backends.protocol import StorageBackend

if TYPE_CHECKING:
    from hicache.controller.cache import HiCache

__all__ = ["KnownPages", "StorageWriter"]


class KnownPages:
    """A bounded LRU set of page keys known to be in storage (written by us or seen by `exists`).

    It spares a storage round trip per page already stored when a longer path is written through. A page
    a prefetch could not read (deleted or damaged behind our back) is forgotten (`discard`), so the next
    write-through of its path checks storage again and writes it back if it is gone.
    """

    def __init__(self, capacity: int = 1 << 16) -> None:
        if capacity < 1:
            raise ValueError(f"capacity: must be >= 1, got {capacity}")
        self._capacity = capacity
        self._keys: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def known_prefix(self, keys: Sequence[str]) -> int:
        """How many of `keys`, from the first, are known to be stored."""
        n = 0
        for key in keys:
            if key not in self._keys:
                break
            self._keys.move_to_end(key)
            n += 1
        return n

    def discard(self, keys: Iterable[str]) -> None:
        """Forget `keys`: storage no longer holds them (as far as we know)."""
        for key in keys:
            self._keys.pop(key, None)

    def add(self, keys: Iterable[str]) -> None:
        """Remember `keys` as stored, dropping the least recently used beyond the capacity."""
        for key in keys:
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self._capacity:
            self._keys.popitem(last=False)


class StorageWriter:
    """Writes the backed-up pages on a node's path (and its components' pages) that storage lacks.

    Runs as the job of a `WorkQueue`; the node's path stays host-locked while its pages are read.
    """

    def __init__(self, cache: HiCache, storage: StorageBackend) -> None:
        self._cache = cache
        self._storage = storage
        self.known = KnownPages()

    async def store(self, target: TreeNode) -> None:
        """Write the backed-up pages on `target`'s path to storage, skipping those already stored."""
        await self.store_many([target])

    async def store_many(self, targets: Sequence[TreeNode]) -> None:
        """Write the backed-up pages on every target's path that storage lacks, in one `exists` and one
        `put` call for all of them (pages shared by several paths once).

        The `exists` call asks about the unknown pages of every path in target order; the leading ones it
        finds are skipped, the rest are put (a page another instance wrote meanwhile may be written
        again: puts are atomic and idempotent). Each target stays host-locked until its pages are written.
        """
        cache = self._cache
        tree = cache.tree
        page = cache.page_size
        locked: list[TreeNode] = []
        keys: list[str] = []
        views: list[memoryview] = []
        seen: set[str] = set()
        try:
            paths: list[tuple[TreeNode, list[TreeNode]]] = []
            evicted = 0
            for target in targets:
                if target.parent is None or target.host_value is None:
                    evicted += 1  # evicted from host (or detached) while its write was queued
                    continue
                path, hashes, values = _backed_up_path(target)
                if not hashes:
                    continue
                tree.lock_host(target)
                locked.append(target)
                paths.append((target, path[: len(values)]))
                target_keys = [h.hex() for h in hashes]
                stored = self.known.known_prefix(target_keys)
                if stored >= len(target_keys):
                    continue
                target_views = cache.host_pool.page_views(_tokens_from(values, stored * page))
                for key, view in zip(target_keys[stored:], target_views, strict=True):
                    if key not in seen:
                        seen.add(key)
                        keys.append(key)
                        views.append(view)
            if evicted:
                cache.metrics.writes_shed.inc(evicted, tier="storage", reason="evicted")
            if keys:
                stored = await self._storage.exists(keys)
                self.known.add(keys[:stored])
                if stored < len(keys):
                    await self._put(keys[stored:], views[stored:])
            if cache.components:
                for target, path in paths:
                    await self._store_components(path, target)
        finally:
            for target in locked:
                tree.unlock_host(target)

    async def _put(self, keys: list[str], views: list[memoryview]) -> None:
        metrics = self._cache.metrics
        try:
            ok = await self._storage.put(keys, views)
        except Exception:
            metrics.storage_page_failures.labels(reason="write").inc(len(views))
            raise
        metrics.storage_bytes_written.inc(sum(len(v) for v, good in zip(views, ok, strict=True) if good))
        self.known.add(key for key, good in zip(keys, ok, strict=True) if good)
        if not all(ok):
            metrics.storage_page_failures.labels(reason="write").inc(len(ok) - sum(ok))

    async def _store_components(self, path: list[TreeNode], target: TreeNode) -> None:
        """Write the host component pages of `path` (host-locked by the caller) that storage lacks.

        Keys are the page hash plus the component name; pages use the component pool's page format.
        Components locked only at the node (Mamba) are written for `target` alone: the lock protects
        no other node's value while the write is in flight.
        """
        cache = self._cache
        page = cache.page_size
        for comp in cache.components:
            host_pool = cache.component_pools[comp.name][1]
            keys: list[str] = []
            views: list[memoryview] = []
            for node in path if comp.lock_path else [target]:
                value = cache.tree.component_value(node, comp.name, "host")
                if value is None:
                    continue
                hashes = node.hashes
                keys.extend(
                    component_storage_key(hashes[i], comp.name)
                    for i in comp.page_hash_index(len(hashes), value, page)
                )
                views.extend(host_pool.page_views(value))
            if not keys or all(key in self.known for key in keys):
                continue
            if await self._storage.exists(keys) >= len(keys):
                self.known.add(keys)
                continue
            await self._put(keys, views)


def _backed_up_path(target: TreeNode) -> tuple[list[TreeNode], list[bytes], list[torch.Tensor]]:
    """The path from the root's child to `target`, and the page hashes and host values of its leading
    backed-up nodes (write-back: pages below an un-backed node cannot be found by prefix)."""
    path: list[TreeNode] = []
    node: TreeNode | None = target
    while node is not None and node.parent is not None:
        path.append(node)
        node = node.parent
    path.reverse()
    hashes: list[bytes] = []
    values: list[torch.Tensor] = []
    for node in path:
        if node.host_value is None:
            break
        hashes.extend(node.hashes)
        values.append(node.host_value)
    return path, hashes, values


def _tokens_from(values: Sequence[torch.Tensor], start: int) -> torch.Tensor:
    """The concatenation of `values` from token `start` on, joining only the nodes it reaches."""
    for i, value in enumerate(values):
        n = int(value.numel())
        if start < n:
            rest = [value[start:], *values[i + 1 :]]
            return rest[0] if len(rest) == 1 else torch.cat(rest)
        start -= n
    return torch.empty(0, dtype=torch.int64)
