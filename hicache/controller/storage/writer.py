"""Host -> storage write-through: after a host backup commits, its pages go to storage in the background."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from hicache.components import component_storage_key
from hicache.controller.pages.allocation import ComponentPools
from hicache.controller.pages.release import ReleaseQueue
from hicache.controller.storage.guarded import GuardedStorage
from hicache.memory import KVPool
from hicache.metrics import CacheMetrics
from hicache.tiers import Tier
from hicache.tree import NodeRef, RadixTree, StoredPath
from storage_backends.cancellation import StopScope
from storage_backends.protocol import StorageBackend
from storage_backends.threads import stray_threads

__all__ = ["KnownPages", "StorageWriter"]

logger = logging.getLogger("hicache.storage_writer")


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

    Runs as the job of a `WorkQueue`; the node's path stays host-locked while its pages are read, and
    beyond: a `put` that times out (`storage_write_timeout_s`) abandons its worker threads, and the lock is
    let go only once none of them reads the host pages any more.

    Args:
        storage: the storage backend (behind its circuit breaker).
        tree: the radix tree (the paths written are host-locked there while their pages are read).
        host_pool: the host pool the pages are read from.
        component_pools: the hybrid components' pools, by name.
        release_queue: where host pages a stray write thread may still read are quarantined.
        metrics: the cache's metric set.
        read_timeout_s: the bound of one `exists` call.
        write_timeout_s: the bound of one `put` call.
    """

    def __init__(
        self,
        storage: StorageBackend,
        *,
        tree: RadixTree,
        host_pool: KVPool,
        component_pools: Mapping[str, ComponentPools],
        release_queue: ReleaseQueue,
        metrics: CacheMetrics,
        read_timeout_s: float,
        write_timeout_s: float,
    ) -> None:
        self._storage = storage
        self._tree = tree
        self._host_pool = host_pool
        self._component_pools = component_pools
        self._release_queue = release_queue
        self._metrics = metrics
        self._read_timeout_s = read_timeout_s
        self._write_timeout_s = write_timeout_s
        self.known = KnownPages()

    async def store_many(self, targets: Sequence[NodeRef], *, on_done: Callable[[], None]) -> None:
        """Write the backed-up pages on every target's path that storage lacks, in one `exists` and one
        `put` call for all of them (pages shared by several paths once).

        The `exists` call asks about the unknown pages of every path in target order; the leading ones it
        finds are skipped, the rest are put (a page another instance wrote meanwhile may be written
        again: puts are atomic and idempotent).

        Args:
            targets: the nodes whose paths to write. The caller host-locked them when it queued the write
                (so host eviction cannot take a queued write's pages) and holds the locks until `on_done`.
            on_done: called, once, when no thread reads the targets' pages any more (at once, or when a
                stray write thread returns): the caller lets go of its host locks then.
        """
        tree = self._tree
        page = self._host_pool.page_size
        keys: list[str] = []
        views: list[memoryview] = []
        seen: set[str] = set()
        touched: list[memoryview] = []
        """Host page buffers this call handed to `put` (a stray write thread may still read them)."""
        try:
            paths: list[tuple[NodeRef, StoredPath]] = []
            # The unknown pages of every path, as token indices, and which of them to put (a page shared
            # by several paths once): their views come from one `page_views` call for the whole batch.
            parts: list[torch.Tensor] = []
            picks: list[int] = []
            offset = 0
            for target in targets:
                path = tree.stored_path(target)
                assert path is not None, "a queued write's target is host-locked: it stays backed up"
                hashes, values = path.hashes, path.host_values
                if not hashes:
                    continue
                paths.append((target, path))
                target_keys = [h.hex() for h in hashes]
                stored = self.known.known_prefix(target_keys)
                fresh = len(keys)
                for i in range(stored, len(target_keys)):
                    key = target_keys[i]
                    if key not in seen:
                        seen.add(key)
                        keys.append(key)
                        picks.append(offset + i - stored)
                if len(keys) > fresh:
                    parts.append(_tokens_from(values, stored * page))
                    offset += len(target_keys) - stored
            if parts:
                pool_views = self._host_pool.page_views(parts[0] if len(parts) == 1 else torch.cat(parts))
                views = [pool_views[i] for i in picks]
            if keys:
                found = await self._exists(keys)
                if found is None:
                    return
                self.known.add(keys[:found])
                if found < len(keys):
                    await self._put(keys[found:], views[found:], touched)
            if tree.components:
                for target, path in paths:
                    await self._store_components(path, target, touched)
        finally:
            if stray_threads.busy(touched):
                # A stray write thread still reads these host pages: keep them locked until it returns.
                self._release_queue.quarantine(
                    torch.empty(0, dtype=torch.int64), views=touched, on_quiet=on_done
                )
            else:
                on_done()

    async def _exists(self, keys: list[str]) -> int | None:
        """`storage.exists` under the read timeout; None (counted) when it timed out."""
        async with StopScope(self._read_timeout_s) as deadline:
            return await self._storage.exists(keys)
        assert deadline.cut_short
        self._record_timeout("exists")
        self._metrics.storage_page_failures.labels(reason="timeout").inc()
        logger.warning("write-through: storage lookup of %d pages timed out", len(keys))
        return None

    def _record_timeout(self, op: str) -> None:
        """A call that timed out is a storage error for the circuit breaker (when storage has one)."""
        if isinstance(self._storage, GuardedStorage):
            self._storage.record_timeout(op)

    async def _put(self, keys: list[str], views: list[memoryview], touched: list[memoryview]) -> None:
        """`storage.put` under the write timeout, counted; `views` join `touched` before the call."""
        metrics = self._metrics
        touched.extend(views)
        timeout = self._write_timeout_s
        try:
            async with StopScope(timeout) as deadline:
                ok = await self._storage.put(keys, views)
        except Exception:
            metrics.storage_page_failures.labels(reason="write").inc(len(views))
            raise
        if deadline.cut_short:
            self._record_timeout("put")
            metrics.storage_page_failures.labels(reason="write_timeout").inc(len(views))
            logger.warning("write-through: a put of %d pages timed out after %.3gs", len(views), timeout)
            return
        metrics.storage_bytes_written.inc(sum(len(v) for v, good in zip(views, ok, strict=True) if good))
        self.known.add(key for key, good in zip(keys, ok, strict=True) if good)
        if not all(ok):
            metrics.storage_page_failures.labels(reason="write").inc(len(ok) - sum(ok))

    async def _store_components(self, path: StoredPath, target: NodeRef, touched: list[memoryview]) -> None:
        """Write the host component pages of `path` (host-locked by the caller) that storage lacks.

        Keys are the page hash plus the component name; pages use the component pool's page format.
        Components locked only at the node (Mamba) are written for `target` alone: the lock protects
        no other node's value while the write is in flight.
        """
        page = self._host_pool.page_size
        for comp in self._tree.components:
            host_pool = self._component_pools[comp.name].host
            keys: list[str] = []
            views: list[memoryview] = []
            nodes = path.nodes if comp.lock_path else (target,)
            node_hashes = path.node_hashes if comp.lock_path else (tuple(self._tree.page_hashes(target)),)
            for node, hashes in zip(nodes, node_hashes, strict=True):
                value = self._tree.component_value(node, comp.name, Tier.HOST)
                if value is None:
                    continue
                keys.extend(
                    component_storage_key(hashes[i], comp.name)
                    for i in comp.page_hash_index(len(hashes), value, page)
                )
                views.extend(host_pool.page_views(value))
            if not keys or all(key in self.known for key in keys):
                continue
            found = await self._exists(keys)
            if found is None:
                return
            if found >= len(keys):
                self.known.add(keys)
                continue
            await self._put(keys, views, touched)


def _tokens_from(values: Sequence[torch.Tensor], start: int) -> torch.Tensor:
    """The concatenation of `values` from token `start` on, joining only the nodes it reaches."""
    for i, value in enumerate(values):
        n = int(value.numel())
        if start < n:
            rest = [value[start:], *values[i + 1 :]]
            return rest[0] if len(rest) == 1 else torch.cat(rest)
        start -= n
    return torch.empty(0, dtype=torch.int64)
