"""The radix tree of KV pages: pure, synchronous bookkeeping over the device and host tiers.

The tree decides and the controller executes: operations return records (`MatchResult`, `InsertResult`,
`EvictResult`, ...) saying which indices to free and which nodes to back up; the tree never awaits and
never touches a pool or a storage backend.
"""

from __future__ import annotations

import itertools
import logging
import sys
from array import array

import torch

from hicache.keys import TOKEN_BYTES, KeyLike, Namespace, as_key_bytes
from hicache.policy import EvictionPolicy, WritePolicy, parse_policy
from hicache.tree.eviction import LeafSet
from hicache.tree.node import TreeNode
from hicache.tree.results import (
    EMPTY_INDICES,
    EvictResult,
    HostEvictResult,
    InsertResult,
    MatchResult,
    TreeStatistics,
)

__all__ = ["RadixTree"]

logger = logging.getLogger("hicache.tree")

_WB = WritePolicy.WRITE_BACK
_LITTLE = sys.byteorder == "little"


def _check_indices(value: object, name: str, expected: int) -> torch.Tensor:
    """Validate a 1-D int64 CPU tensor of `expected` entries; raise naming `name` otherwise."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a 1-D int64 tensor, got {type(value).__name__}")
    if value.dtype != torch.int64:
        raise TypeError(f"{name}: expected dtype torch.int64, got {value.dtype}")
    if value.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D tensor, got shape {tuple(value.shape)}")
    if value.shape[0] != expected:
        raise ValueError(f"{name}: expected {expected} entries (one per token), got {value.shape[0]}")
    return value


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    if not parts:
        return EMPTY_INDICES
    if len(parts) == 1:
        return parts[0]
    return torch.cat(parts)


class RadixTree:
    """A paged radix tree of token keys whose nodes hold device and host pool indices.

    Args:
        page_size: tokens per page (>= 1); matching and insertion ignore a trailing partial page.
        write_policy: when device pages are backed up to the host (`WritePolicy` or its name).
        eviction_policy: which evictable leaf goes first (`EvictionPolicy` or its name).
        write_through_threshold: hits before a node is backed up under `write_through_selective` (>= 1).
        namespace: the cache's namespace, mixed into every page hash.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: a page size below 1, a threshold below 1, or an unknown policy name.
    """

    def __init__(
        self,
        page_size: int,
        write_policy: WritePolicy | str = "write_through",
        eviction_policy: EvictionPolicy | str = "lru",
        write_through_threshold: int = 2,
        namespace: Namespace | None = None,
    ) -> None:
        if isinstance(page_size, bool) or not isinstance(page_size, int):
            raise TypeError(f"page_size: expected an int, got {type(page_size).__name__}")
        if page_size < 1:
            raise ValueError(f"page_size: must be >= 1, got {page_size}")
        if isinstance(write_through_threshold, bool) or not isinstance(write_through_threshold, int):
            raise TypeError(
                f"write_through_threshold: expected an int, got {type(write_through_threshold).__name__}"
            )
        if write_through_threshold < 1:
            raise ValueError(f"write_through_threshold: must be >= 1, got {write_through_threshold}")
        if namespace is None:
            namespace = Namespace()
        if not isinstance(namespace, Namespace):
            raise TypeError(f"namespace: expected a Namespace, got {type(namespace).__name__}")
        self.page_size = page_size
        self.write_policy = parse_policy(WritePolicy, write_policy, "write_policy")
        self.eviction_policy = parse_policy(EvictionPolicy, eviction_policy, "eviction_policy")
        self.write_through_threshold = write_through_threshold
        self.namespace = namespace
        self._step = page_size * TOKEN_BYTES
        self._ctx = (page_size, namespace)
        self._ids = itertools.count(1)
        self._clock = 0
        # The hit count at which an inserted node is backed up (None: never at insert).
        self._backup_hits: int | None = {
            WritePolicy.WRITE_THROUGH: 1,
            WritePolicy.WRITE_THROUGH_SELECTIVE: write_through_threshold,
            WritePolicy.WRITE_BACK: None,
        }[self.write_policy]
        self.root = TreeNode(0, None, b"", self._ctx)
        self.root.hashes = []
        self._device_leaves = LeafSet(self.eviction_policy)
        self._host_leaves = LeafSet(self.eviction_policy)
        self._num_nodes = 0
        self._device_tokens = 0
        self._host_tokens = 0
        self._pending_tokens = 0
        self._evictable_size = 0
        self._protected_size = 0
        self._evictable_host = 0

    # ------------------------------------------------------------------ value bookkeeping
    # Every change of a node's values goes through these helpers, which keep the counters, the
    # parent's count of device children and the leaf sets up to date. Hybrid components (a later issue)
    # extend `_set_device`, `_set_host` and `_split_values` rather than the operations.

    def _set_device(self, node: TreeNode, value: torch.Tensor | None) -> None:
        old = node.device_value
        n = len(node.key) >> 3
        delta = (value is not None) - (old is not None)
        node.device_value = value
        if delta:
            self._device_tokens += delta * n
            if node.device_lock:
                self._protected_size += delta * n
            else:
                self._evictable_size += delta * n
            parent = node.parent
            if parent is not None:
                parent._dev_children += delta
                self._refresh(parent)
        self._refresh(node)

    def _set_host(self, node: TreeNode, value: torch.Tensor | None) -> None:
        old = node.host_value
        n = len(node.key) >> 3
        delta = (value is not None) - (old is not None)
        node.host_value = value
        if delta:
            self._host_tokens += delta * n
            if not node.host_lock:
                self._evictable_host += delta * n
        self._refresh(node)

    def _split_values(self, node: TreeNode, upper: TreeNode, tokens: int) -> None:
        """Move the first `tokens` tokens' values of `node` to its new parent `upper` (token counts only
        change hands between the two, so the counters stay)."""
        dv = node.device_value
        if dv is not None:
            upper.device_value = dv[:tokens]
            node.device_value = dv[tokens:]
            upper._dev_children = 1
        hv = node.host_value
        if hv is not None:
            upper.host_value = hv[:tokens]
            node.host_value = hv[tokens:]
        pv = node.backup_pending
        if pv is not None:
            upper.backup_pending = pv[:tokens]
            node.backup_pending = pv[tokens:]
            upper._backup_owner = node._backup_owner or node
        hashes = node._hashes
        if hashes is not None:
            pages = tokens // self.page_size
            upper._hashes = hashes[:pages]
            node._hashes = hashes[pages:]

    def _refresh(self, node: TreeNode) -> None:
        """Recompute whether `node` is an evictable device leaf or host leaf."""
        if node.parent is None:
            return
        if node.device_value is not None:
            self._host_leaves.discard(node)
            if not node._dev_children and not node.device_lock and node.backup_pending is None:
                self._device_leaves.add(node)
            else:
                self._device_leaves.discard(node)
        else:
            self._device_leaves.discard(node)
            if (
                node.host_value is not None
                and not node.children
                and not node.host_lock
                and not node.device_lock
            ):
                self._host_leaves.add(node)
            else:
                self._host_leaves.discard(node)

    def _split(self, node: TreeNode, nbytes: int) -> TreeNode:
        """Split `node` after `nbytes` key bytes; the new upper part is returned, `node` keeps the rest."""
        parent = node.parent
        assert parent is not None
        upper = TreeNode(next(self._ids), parent, node.key[:nbytes], self._ctx)
        upper.device_lock = node.device_lock
        upper.host_lock = node.host_lock
        upper.hit_count = node.hit_count
        upper.last_access = node.last_access
        upper.priority = node.priority
        self._split_values(node, upper, nbytes >> 3)
        rest = node.key[nbytes:]
        node.key = rest
        node.parent = upper
        upper.children[rest[: self._step]] = node
        parent.children[upper.key[: self._step]] = upper
        self._num_nodes += 1
        return upper

    def _new_node(self, parent: TreeNode, key: bytes) -> TreeNode:
        node = TreeNode(next(self._ids), parent, key, self._ctx)
        parent.children[key[: self._step]] = node
        self._num_nodes += 1
        return node

    def _detach(self, node: TreeNode) -> None:
        """Remove a childless node from the tree (its values must already have been taken)."""
        parent = node.parent
        assert parent is not None
        assert not node.children
        self._set_device(node, None)
        self._set_host(node, None)
        del parent.children[node.key[: self._step]]
        self._device_leaves.discard(node)
        self._host_leaves.discard(node)
        node.parent = None
        self._num_nodes -= 1
        self._refresh(parent)

    def _matched_bytes(self, kb: bytes, pos: int, ck: bytes) -> int:
        """Key bytes of `ck` matched by `kb[pos:]`, in whole pages (the first page is known to match)."""
        if kb.startswith(ck, pos):
            return len(ck)
        step = self._step
        end = min(len(ck), len(kb) - pos)
        i = step
        while i < end and kb[pos + i : pos + i + step] == ck[i : i + step]:
            i += step
        return i

    def _aligned_key(self, key: KeyLike, name: str = "key") -> tuple[bytes, int]:
        kb = as_key_bytes(key, name=name)
        n = len(kb)
        aligned = n - n % self._step
        return (kb if aligned == n else kb[:aligned]), n >> 3

    def _require_live(self, node: object, name: str = "node") -> TreeNode:
        if not isinstance(node, TreeNode):
            raise TypeError(f"{name}: expected a TreeNode, got {type(node).__name__}")
        cur = node
        step = self._step
        while cur is not self.root:
            parent = cur.parent
            if parent is None or parent.children.get(cur.key[:step]) is not cur:
                raise ValueError(f"{name}: node {node.id} is not a live node of this tree")
            cur = parent
        return node

    def _require_non_root(self, node: object, name: str = "node") -> TreeNode:
        live = self._require_live(node, name)
        if live is self.root:
            raise ValueError(f"{name}: the root holds no pages")
        return live

    # ------------------------------------------------------------------ matching and inserting

    def match_prefix(self, key: KeyLike) -> MatchResult:
        """Find the longest cached page-aligned prefix of `key` on the device and, beyond it, on the host.

        A match ending inside a node splits it; every matched node's `last_access` is advanced.

        Args:
            key: the token key (bytes, `array('q')`, a 1-D integer tensor or a sequence of ints).

        Raises:
            TypeError, ValueError: for a key that cannot be converted (see `hicache.keys.as_key_bytes`).
        """
        # Fast path for the common key types (the conversion is otherwise `as_key_bytes`).
        if type(key) is array and key.typecode == "q" and _LITTLE:
            kb = key.tobytes()
        elif type(key) is bytes and not len(key) & 7:
            kb = key
        else:
            kb = as_key_bytes(key)
        step = self._step
        end = len(kb)
        if end % step:
            end -= end % step
            kb = kb[:end]
        self._clock += 1
        tick = self._clock
        root = self.root
        node = root
        pos = 0
        device_values: list[torch.Tensor] = []
        device_bytes = 0
        host_nodes: list[TreeNode] = []
        last_device = root
        last_host = root
        while pos < end:
            child = node.children.get(kb[pos : pos + step])
            if child is None:
                break
            ck = child.key
            if kb.startswith(ck, pos):
                matched = len(ck)
            else:
                matched = self._matched_bytes(kb, pos, ck)
                child = self._split(child, matched)
            child.last_access = tick
            dv = child.device_value
            if dv is not None:
                device_values.append(dv)
                device_bytes += matched
                last_device = child
            else:
                host_nodes.append(child)
            if child.host_value is not None:
                last_host = child
            pos += matched
            node = child
        return MatchResult(
            kb,
            tuple(device_values),
            device_bytes >> 3,
            (pos - device_bytes) >> 3,
            last_device,
            last_host,
            tuple(host_nodes),
        )

    def insert(self, key: KeyLike, device_indices: torch.Tensor) -> InsertResult:
        """Insert a key whose KV pages sit at `device_indices` on the device.

        Only the page-aligned part is inserted. Nodes that already hold device data are duplicates (the
        caller frees `device_indices[:prefix_len]`); host-only nodes on the path get the caller's device
        values re-attached; the rest becomes a new leaf. Every existing node on the path counts a hit, a
        new node starts at one hit (zero under write-back); nodes reaching the policy's threshold are
        returned in `backups`.

        Args:
            key: the token key.
            device_indices: a 1-D int64 tensor with one device index per token of the (unaligned) key.

        Raises:
            TypeError: a key or `device_indices` of the wrong type or dtype.
            ValueError: `device_indices` of the wrong shape or length.
        """
        kb, ntok = self._aligned_key(key)
        _check_indices(device_indices, "device_indices", ntok)
        self._clock += 1
        tick = self._clock
        step = self._step
        end = len(kb)
        backup_hits = self._backup_hits
        backups: list[TreeNode] = []
        node = self.root
        pos = 0
        prefix_bytes = 0
        values: torch.Tensor | None = (
            None  # the caller's indices from the first non-duplicate token, cloned once
        )
        base = 0
        while pos < end:
            child = node.children.get(kb[pos : pos + step])
            if child is None:
                break
            ck = child.key
            if kb.startswith(ck, pos):
                matched = len(ck)
            else:
                matched = self._matched_bytes(kb, pos, ck)
                child = self._split(child, matched)
            child.last_access = tick
            child.hit_count += 1
            if child.device_value is not None:
                prefix_bytes += matched
            else:
                if values is None:
                    values = device_indices[pos >> 3 : end >> 3].clone()
                    base = pos >> 3
                self._set_device(child, values[(pos >> 3) - base : (pos + matched >> 3) - base])
            if (
                backup_hits is not None
                and child.hit_count >= backup_hits
                and child.host_value is None
                and child.backup_pending is None
            ):
                backups.append(child)
            pos += matched
            node = child
        if pos < end:
            if values is None:
                values = device_indices[pos >> 3 : end >> 3].clone()
                base = pos >> 3
            leaf = self._new_node(node, kb[pos:])
            leaf.last_access = tick
            if backup_hits is not None:
                leaf.hit_count = 1
                if backup_hits <= 1:
                    backups.append(leaf)
            self._set_device(leaf, values[(pos >> 3) - base :])
            node = leaf
        return InsertResult(prefix_bytes >> 3, end >> 3, node, tuple(backups))

    def insert_host(
        self,
        anchor: TreeNode,
        key: KeyLike,
        host_indices: torch.Tensor,
        hashes: list[bytes] | None = None,
    ) -> InsertResult:
        """Attach a storage refill (host pages) below `anchor`.

        `key` continues from the end of `anchor`'s key. Tokens already in the tree count as present (the
        caller frees `host_indices[:prefix_len]`). If the rest would hang below a node that is neither the
        root nor backed up and the policy is not write-back, nothing is attached and
        `host_insert_dropped` is set: the caller frees every host index.

        Args:
            anchor: a live node of this tree (the match's last host node, host-locked by the caller).
            key: the refill's tokens, continuing from the anchor's end.
            host_indices: a 1-D int64 tensor with one host index per token of `key`.
            hashes: the precomputed page hashes of the page-aligned `key`, if known.

        Raises:
            TypeError, ValueError: for a dead anchor or malformed key, indices or hashes.
        """
        anchor = self._require_live(anchor, "anchor")
        kb, ntok = self._aligned_key(key)
        _check_indices(host_indices, "host_indices", ntok)
        step = self._step
        end = len(kb)
        if hashes is not None:
            if not isinstance(hashes, list) or not all(isinstance(h, bytes) and len(h) == 16 for h in hashes):
                raise TypeError("hashes: expected a list of 16-byte hashes")
            if len(hashes) != end // step:
                raise ValueError(f"hashes: expected {end // step} page hashes, got {len(hashes)}")
        # A dry walk first: a dropped refill must leave the tree untouched (no split either).
        node = anchor
        pos = 0
        attach_backed = True
        attach_id = node.id
        while pos < end:
            child = node.children.get(kb[pos : pos + step])
            if child is None:
                attach_backed = node is self.root or node.host_value is not None
                attach_id = node.id
                break
            matched = self._matched_bytes(kb, pos, child.key)
            pos += matched
            if matched < len(child.key):
                attach_backed = child.host_value is not None
                attach_id = child.id
                break
            node = child
        if pos < end and not attach_backed and self.write_policy is not _WB:
            logger.info(
                "insert_host dropped %d refill tokens: attach point node %d is not backed up",
                (end - pos) >> 3,
                attach_id,
            )
            return InsertResult(0, 0, anchor, (), True)
        self._clock += 1
        tick = self._clock
        node = anchor
        pos = 0
        while pos < end:
            child = node.children.get(kb[pos : pos + step])
            if child is None:
                break
            matched = self._matched_bytes(kb, pos, child.key)
            if matched < len(child.key):
                child = self._split(child, matched)
            child.last_access = tick
            pos += matched
            node = child
        prefix = pos >> 3
        if pos < end:
            leaf = self._new_node(node, kb[pos:])
            leaf.last_access = tick
            if hashes is not None:
                leaf._hashes = hashes[pos // step :]
            self._set_host(leaf, host_indices[prefix : end >> 3].clone())
            self._refresh(node)
            node = leaf
        return InsertResult(prefix, end >> 3, node)

    # ------------------------------------------------------------------ device -> host backups

    def backup_chain(self, node: TreeNode) -> list[TreeNode]:
        """The nodes to back up so that `node` can be backed up: from the topmost un-backed, not-pending
        ancestor down to `node`, root-first ([] if `node` is detached, backed up or pending)."""
        if not isinstance(node, TreeNode):
            raise TypeError(f"node: expected a TreeNode, got {type(node).__name__}")
        try:
            self._require_non_root(node)
        except ValueError:
            return []
        chain: list[TreeNode] = []
        cur = node
        while cur is not self.root and cur.host_value is None and cur.backup_pending is None:
            chain.append(cur)
            assert cur.parent is not None
            cur = cur.parent
        chain.reverse()
        return chain

    def begin_backup(self, node: TreeNode, host_indices: torch.Tensor) -> None:
        """Record a device-to-host backup of `node` in flight to `host_indices`; device-locks its path.

        Raises:
            ValueError: the node holds no device data, is backed up or pending, or the indices mismatch.
        """
        node = self._require_non_root(node)
        _check_indices(host_indices, "host_indices", node.num_tokens)
        if node.device_value is None:
            raise ValueError(f"node: node {node.id} holds no device data to back up")
        if node.host_value is not None or node.backup_pending is not None:
            raise ValueError(f"node: node {node.id} is already backed up or has a backup in flight")
        node.backup_pending = host_indices
        node._backup_owner = None
        self._pending_tokens += node.num_tokens
        self.lock_device(node)

    def _pending_group(self, node: TreeNode) -> list[TreeNode]:
        """`node` and the upper parts split off it while its backup was in flight, root-first."""
        group = [node]
        cur = node.parent
        while cur is not None and cur._backup_owner is node and cur.backup_pending is not None:
            group.append(cur)
            cur = cur.parent
        group.reverse()
        return group

    def commit_backup(self, node: TreeNode) -> None:
        """The backup of `node` completed: its pending host indices become its host value; unlocks.

        Upper parts split off the node while the backup was in flight are committed with it.

        Raises:
            ValueError: no backup in flight, or (except under write-back) the parent is neither the root
                nor backed up: chains are committed root-first.
        """
        node = self._require_non_root(node)
        if node.backup_pending is None:
            raise ValueError(f"node: node {node.id} has no backup in flight")
        group = self._pending_group(node)
        top_parent = group[0].parent
        if self.write_policy is not _WB and top_parent is not self.root:
            assert top_parent is not None
            if top_parent.host_value is None:
                raise ValueError(
                    f"node: cannot commit the backup of node {node.id} before its parent {top_parent.id} "
                    "is backed up (commit chains root-first)"
                )
        for member in group:
            pending = member.backup_pending
            member.backup_pending = None
            member._backup_owner = None
            self._pending_tokens -= member.num_tokens
            self._set_host(member, pending)
        self.unlock_device(node)

    def abort_backup(self, node: TreeNode) -> torch.Tensor:
        """The backup of `node` failed or was cancelled: unlock and return its host indices to free.

        Raises:
            ValueError: no backup in flight.
        """
        node = self._require_non_root(node)
        if node.backup_pending is None:
            raise ValueError(f"node: node {node.id} has no backup in flight")
        parts = []
        for member in self._pending_group(node):
            pending = member.backup_pending
            assert pending is not None
            parts.append(pending)
            member.backup_pending = None
            member._backup_owner = None
            self._pending_tokens -= member.num_tokens
        self.unlock_device(node)
        return _cat(parts)

    # ------------------------------------------------------------------ host -> device and demotion

    def attach_device(self, node: TreeNode, device_indices: torch.Tensor) -> None:
        """Record that a host-only node was loaded back to the device at `device_indices`.

        Raises:
            ValueError: the node is not host-only, its parent is not on the device, or a length mismatch.
        """
        node = self._require_non_root(node)
        _check_indices(device_indices, "device_indices", node.num_tokens)
        if node.device_value is not None or node.host_value is None:
            raise ValueError(f"node: node {node.id} is not host-only")
        parent = node.parent
        assert parent is not None
        if parent is not self.root and parent.device_value is None:
            raise ValueError(f"node: the parent {parent.id} of node {node.id} is not on the device")
        self._set_device(node, device_indices)

    def demote(self, node: TreeNode) -> torch.Tensor:
        """Drop the device copy of a backed-up node and return its device indices for the caller to free.

        Raises:
            ValueError: the node is not backed up, holds no device data, is device-locked, or has a child
                on the device.
        """
        node = self._require_non_root(node)
        dv = node.device_value
        if dv is None:
            raise ValueError(f"node: node {node.id} holds no device data")
        if node.host_value is None:
            raise ValueError(f"node: node {node.id} is not backed up")
        if node.device_lock:
            raise ValueError(f"node: node {node.id} is device-locked")
        if node._dev_children:
            raise ValueError(f"node: node {node.id} has a child on the device")
        self._set_device(node, None)
        return dv

    # ------------------------------------------------------------------ locks and priority

    def _path(self, node: object) -> list[TreeNode]:
        live = self._require_live(node)
        path = []
        cur = live
        while cur is not self.root:
            path.append(cur)
            assert cur.parent is not None
            cur = cur.parent
        return path

    def lock_device(self, node: TreeNode) -> None:
        """Protect `node` and its ancestors from device eviction (counted; the root is excluded)."""
        for cur in self._path(node):
            cur.device_lock += 1
            if cur.device_lock == 1:
                if cur.device_value is not None:
                    n = cur.num_tokens
                    self._evictable_size -= n
                    self._protected_size += n
                self._refresh(cur)

    def unlock_device(self, node: TreeNode) -> None:
        """Release one device lock on `node` and its ancestors.

        Raises:
            ValueError: the node is not device-locked.
        """
        path = self._path(node)
        if path and path[0].device_lock <= 0:
            raise ValueError(f"node: node {path[0].id} is not device-locked")
        for cur in path:
            cur.device_lock -= 1
            if cur.device_lock == 0:
                if cur.device_value is not None:
                    n = cur.num_tokens
                    self._evictable_size += n
                    self._protected_size -= n
                self._refresh(cur)

    def lock_host(self, node: TreeNode) -> None:
        """Protect `node` and its ancestors from host eviction (counted; the root is excluded)."""
        for cur in self._path(node):
            cur.host_lock += 1
            if cur.host_lock == 1:
                if cur.host_value is not None:
                    self._evictable_host -= cur.num_tokens
                self._refresh(cur)

    def unlock_host(self, node: TreeNode) -> None:
        """Release one host lock on `node` and its ancestors.

        Raises:
            ValueError: the node is not host-locked.
        """
        path = self._path(node)
        if path and path[0].host_lock <= 0:
            raise ValueError(f"node: node {path[0].id} is not host-locked")
        for cur in path:
            cur.host_lock -= 1
            if cur.host_lock == 0:
                if cur.host_value is not None:
                    self._evictable_host += cur.num_tokens
                self._refresh(cur)

    def set_priority(self, node: TreeNode, priority: int) -> None:
        """Set the eviction priority of `node` (lower goes first under the priority policy)."""
        node = self._require_non_root(node)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise TypeError(f"priority: expected an int, got {type(priority).__name__}")
        node.priority = priority
        if node in self._device_leaves:
            self._device_leaves.push(node)
        if node in self._host_leaves:
            self._host_leaves.push(node)

    # ------------------------------------------------------------------ eviction

    @staticmethod
    def _check_count(value: object, name: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
        if value < 0:
            raise ValueError(f"{name}: must be >= 0, got {value}")
        return value

    def evict_device(self, num_tokens: int, host_free_tokens: int = 0) -> EvictResult:
        """Free at least `num_tokens` device tokens from evictable device leaves, in policy order.

        Backed-up leaves are demoted; un-backed ones are deleted (write-through), or under write-back
        returned in `backup_first` while `host_free_tokens` can take them and dropped with their subtree
        beyond that. Stops early (a value, not an error) when nothing more is evictable.

        Args:
            num_tokens: device tokens wanted.
            host_free_tokens: host tokens free for write-back backups.

        Raises:
            TypeError, ValueError: a count that is not a non-negative int.
        """
        self._check_count(num_tokens, "num_tokens")
        room = self._check_count(host_free_tokens, "host_free_tokens")
        leaves = self._device_leaves
        write_back = self.write_policy is _WB
        freed_device: list[torch.Tensor] = []
        freed_host: list[torch.Tensor] = []
        backup_first: list[TreeNode] = []
        skipped: list[TreeNode] = []
        got = 0
        while got < num_tokens:
            node = leaves.pop()
            if node is None:
                break
            n = len(node.key) >> 3
            dv = node.device_value
            assert dv is not None
            if node.host_value is not None:
                self._set_device(node, None)
                freed_device.append(dv)
                got += n
            elif write_back:
                if room >= n:
                    room -= n
                    backup_first.append(node)
                    skipped.append(node)
                    got += n
                elif not node.host_lock:
                    self._drop_subtree(node, freed_device, freed_host)
                    got += n
                else:
                    skipped.append(node)
            elif not node.children and not node.host_lock:
                self._detach(node)
                freed_device.append(dv)
                got += n
            else:  # host-locked (children are excluded by the write-through invariant)
                skipped.append(node)
        for node in skipped:
            leaves.push(node)
        return EvictResult(_cat(freed_device), _cat(freed_host), got, tuple(backup_first))

    def _drop_subtree(
        self, node: TreeNode, freed_device: list[torch.Tensor], freed_host: list[torch.Tensor]
    ) -> None:
        """Delete `node` and its (host-only, unlocked) descendants, collecting their indices."""
        stack = [node]
        order: list[TreeNode] = []
        while stack:
            cur = stack.pop()
            order.append(cur)
            stack.extend(cur.children.values())
        for cur in reversed(order):  # children before parents
            if cur.device_value is not None:
                freed_device.append(cur.device_value)
            if cur.host_value is not None:
                freed_host.append(cur.host_value)
            self._detach(cur)

    def evict_host(self, num_tokens: int) -> HostEvictResult:
        """Free at least `num_tokens` host tokens by removing host-only leaves in policy order.

        Stops early (a value, not an error) when nothing more is evictable.

        Raises:
            TypeError, ValueError: a count that is not a non-negative int.
        """
        self._check_count(num_tokens, "num_tokens")
        leaves = self._host_leaves
        freed: list[torch.Tensor] = []
        got = 0
        while got < num_tokens:
            node = leaves.pop()
            if node is None:
                break
            hv = node.host_value
            assert hv is not None
            freed.append(hv)
            got += len(node.key) >> 3
            self._detach(node)
        return HostEvictResult(_cat(freed), got)

    # ------------------------------------------------------------------ observation

    def statistics(self) -> TreeStatistics:
        """A snapshot of the tree's sizes (O(1): the counters are kept incrementally)."""
        return TreeStatistics(
            num_nodes=self._num_nodes,
            device_tokens=self._device_tokens,
            host_tokens=self._host_tokens,
            pending_backup_tokens=self._pending_tokens,
            evictable_device_tokens=self._evictable_size,
            protected_device_tokens=self._protected_size,
            evictable_host_tokens=self._evictable_host,
        )

    def evictable_size(self) -> int:
        """Device tokens in nodes without a device lock."""
        return self._evictable_size

    def protected_size(self) -> int:
        """Device tokens in device-locked nodes."""
        return self._protected_size

    def iter_nodes(self) -> list[TreeNode]:
        """Every node except the root, parents before children (O(tree): for tests and diagnostics)."""
        out: list[TreeNode] = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def device_tokens_owned(self) -> torch.Tensor:
        """Every device index the tree holds (O(tree): for exact pool accounting in tests)."""
        return _cat([n.device_value for n in self.iter_nodes() if n.device_value is not None])

    def host_tokens_owned(self) -> torch.Tensor:
        """Every host index the tree holds, pending backups included (O(tree): for pool accounting)."""
        parts = []
        for n in self.iter_nodes():
            if n.host_value is not None:
                parts.append(n.host_value)
            if n.backup_pending is not None:
                parts.append(n.backup_pending)
        return _cat(parts)

    def sanity_check(self) -> None:
        """Check every invariant of the tree (O(tree)).

        Raises:
            InvariantViolation: listing every violated invariant.
        """
        from hicache.tree.sanity import check_tree

        check_tree(self)

    def __repr__(self) -> str:
        s = self.statistics()
        return (
            f"RadixTree(page_size={self.page_size}, write_policy={self.write_policy.value}, "
            f"eviction_policy={self.eviction_policy.value}, nodes={s.num_nodes}, device_tokens="
            f"{s.device_tokens}, host_tokens={s.host_tokens}, "
            f"pending_backup_tokens={s.pending_backup_tokens}, "
            f"evictable_device_tokens={s.evictable_device_tokens}, device_leaves={len(self._device_leaves)}, "
            f"host_leaves={len(self._host_leaves)})"
        )
