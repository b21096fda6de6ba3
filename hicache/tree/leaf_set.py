"""Leaf sets ordered by the eviction policy, kept incrementally (what eviction pops from).

Each set pairs the members (the leaves evictable right now) with a lazy min-heap of
`(policy key, node id, sequence, node)` entries. A node's key only grows between pushes (the logical clock
and hit counts are monotonic; `set_priority` pushes a fresh entry), so every stored key is at most the
node's current key: popping the smallest entry whose stored key is still current yields the true minimum.
Entries whose key went stale are re-pushed with the current key; entries of non-members are dropped. No
operation scans the whole tree.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from hicache.policy import EvictionPolicy
from hicache.tree.node import TreeNode

__all__ = ["LeafSet", "SortKey", "sort_key_function"]

SortKey = int | tuple[int, int]
"""What a leaf is ordered by: smaller goes first."""


def _lru(node: TreeNode) -> SortKey:
    return node.last_access


def _lfu(node: TreeNode) -> SortKey:
    return (node.hit_count, node.last_access)


def _priority(node: TreeNode) -> SortKey:
    return (node.priority, node.last_access)


def sort_key_function(policy: EvictionPolicy) -> Callable[[TreeNode], SortKey]:
    """The ordering of a policy: LRU by last access; LFU by hits then last access; PRIORITY by priority then
    last access."""
    if policy is EvictionPolicy.LRU:
        return _lru
    if policy is EvictionPolicy.LFU:
        return _lfu
    return _priority


class LeafSet:
    """The evictable leaves of one tier, with their policy order.

    Args:
        policy: the eviction policy that orders the leaves.
    """

    __slots__ = ("_heap", "_key", "_seq", "members")

    def __init__(self, policy: EvictionPolicy) -> None:
        self.members: set[TreeNode] = set()
        self._heap: list[tuple[SortKey, int, int, TreeNode]] = []
        self._key = sort_key_function(policy)
        self._seq = 0

    def __len__(self) -> int:
        return len(self.members)

    def __contains__(self, node: TreeNode) -> bool:
        return node in self.members

    def add(self, node: TreeNode) -> None:
        """Make `node` a member (no-op if it already is)."""
        if node not in self.members:
            self.members.add(node)
            self.push(node)

    def discard(self, node: TreeNode) -> None:
        """Remove `node` from the members (its heap entries die lazily)."""
        self.members.discard(node)

    def push(self, node: TreeNode) -> None:
        """Record `node`'s current key (after its key decreased, or to return a popped member).

        An insert's new leaf joins its tree's device leaves the same way in C (`node.add_leaf`: a member, an
        entry `(key, id, seq, node)` pushed, a compaction past `2 * len + 64` entries).
        """
        self._seq += 1
        heapq.heappush(self._heap, (self._key(node), node.id, self._seq, node))
        if len(self._heap) > 2 * len(self.members) + 64:
            self._compact()

    def pop(self) -> TreeNode | None:
        """Take the member that goes first out of the heap (it stays a member), or `None` if there is none.

        The caller must either remove the node from the members or `push` it back.
        """
        heap = self._heap
        members = self.members
        key = self._key
        while heap:
            k, nid, _, node = heap[0]
            if node not in members:
                heapq.heappop(heap)
                continue
            cur = key(node)
            if cur != k:
                self._seq += 1
                heapq.heapreplace(heap, (cur, nid, self._seq, node))
                continue
            heapq.heappop(heap)
            return node
        return None

    def _compact(self) -> None:
        key = self._key
        entries = []
        for node in self.members:
            self._seq += 1
            entries.append((key(node), node.id, self._seq, node))
        heapq.heapify(entries)
        self._heap = entries

    def check(self) -> list[str]:
        """Violations of the heap invariant: each member has an entry keyed at most its current key."""
        best: dict[int, SortKey] = {}
        for k, _, _, node in self._heap:
            if node in self.members:
                prev = best.get(id(node))
                if prev is None or k < prev:  # type: ignore[operator]
                    best[id(node)] = k
        out = []
        for node in self.members:
            stored = best.get(id(node))
            if stored is None:
                out.append(f"leaf {node.id} has no heap entry")
            elif stored > self._key(node):  # type: ignore[operator]
                out.append(f"leaf {node.id} heap key {stored!r} exceeds its current key {self._key(node)!r}")
        return out
