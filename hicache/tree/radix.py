"""The radix tree of KV pages: pure, synchronous bookkeeping over the device and host tiers.

The tree decides and the controller executes: operations return records (`MatchResult`, `InsertResult`,
`EvictResult`, ...) saying which indices to free and which nodes to back up; the tree never awaits and
never touches a pool or a storage backend.

`RadixTree` is one class: it holds the nodes, the counters and the leaf sets, and the primitives that
change a node's values while keeping all of them exact (`_set_device`, `_set_host`, `_split`, `_detach`,
...). Its operations are plain functions over it, one module per job, bound here as its methods: matching
and queries (`matching`), inserting (`inserting`), backups and locks (`backups`), load-back (`load_back`)
and eviction planning (`eviction`); hybrid components keep their per-node data in a `ComponentBook`
(`component_book`), and the walk down whole device nodes runs in C (`node.walk`). Callers hold `NodeRef`
handles (`handles`), never nodes.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

import torch

from hicache.components.base import Component
from hicache.keys import TOKEN_BYTES, KeyLike, Namespace, as_key_bytes
from hicache.policy import EvictionPolicy, WritePolicy, parse_policy
from hicache.tree import backups, eviction, inserting, load_back, matching
from hicache.tree.checks import cat_indices, check_tier
from hicache.tree.component_book import ComponentBook
from hicache.tree.handles import ComponentInfo, HeldIndices, NodeInfo, NodeRef
from hicache.tree.leaf_set import LeafSet
from hicache.tree.node import TreeNode, bind_tree, new_leaf, new_node
from hicache.tree.results import (
    EMPTY_INDICES,
    BranchStatistics,
    ComponentFree,
    ComponentStatistics,
    TreeStatistics,
)
from hicache.tree.sanity import check_tree

__all__ = ["RadixTree"]

_TREE_SERIALS = itertools.count(1)
_new_ref = tuple.__new__
"""Makes a node's `NodeRef` (a NamedTuple's Python-level `__new__` costs twice as much, once per node)."""


class RadixTree:
    """A paged radix tree of token keys whose nodes hold device and host pool indices.

    Args:
        page_size: tokens per page (>= 1); matching and insertion ignore a trailing partial page.
        write_policy: when device pages are backed up to the host (`WritePolicy` or its name).
        eviction_policy: which evictable leaf goes first (`EvictionPolicy` or its name).
        write_through_threshold: hits before a node is backed up under `write_through_selective` (>= 1).
        namespace: the cache's namespace, mixed into every page hash.
        components: hybrid-model components (sliding-window KV, Mamba state) kept per node beside the
            full-attention KV; `None` or empty for a full-attention-only tree (every operation then runs
            exactly as without components).

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: a page size below 1, a threshold below 1, an unknown policy name, or two components
            with one name.
    """

    # Slots: `add_leaf` (C) reads and writes the counters and tables at their slot offsets.
    __slots__ = (
        "_backup_hits",
        "_book",
        "_clock",
        "_ctx",
        "_device_leaves",
        "_device_tokens",
        "_evictable_host",
        "_evictable_size",
        "_host_leaves",
        "_host_tokens",
        "_ids",
        "_nodes",
        "_path_cache_tokens",
        "_pending_tokens",
        "_protected_size",
        "_reclaimable_host",
        "_root",
        "_serial",
        "_step",
        "eviction_policy",
        "namespace",
        "page_size",
        "write_policy",
        "write_through_threshold",
    )

    def __init__(
        self,
        page_size: int,
        write_policy: WritePolicy | str = "write_through",
        eviction_policy: EvictionPolicy | str = "lru",
        write_through_threshold: int = 2,
        namespace: Namespace | None = None,
        components: Sequence[Component] | None = None,
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
        self._serial = next(_TREE_SERIALS)  # tells this tree's handles from another's
        self._root = new_node(0, None, b"", self._ctx, _new_ref(NodeRef, (self._serial, 0)))
        self._root.hashes = []
        self._nodes: dict[int, TreeNode] = {0: self._root}  # every live node by id, to resolve handles
        self._device_leaves = LeafSet(self.eviction_policy)
        self._host_leaves = LeafSet(self.eviction_policy)
        self._device_tokens = 0
        self._host_tokens = 0
        self._pending_tokens = 0
        self._evictable_size = 0
        self._protected_size = 0
        self._evictable_host = 0
        self._reclaimable_host = 0  # host tokens of host-only nodes without a lock: what evict_host frees
        self._path_cache_tokens = 0  # tokens held by the nodes' cached joined root paths
        # Hybrid components' per-node bookkeeping; `None` in a full-attention-only tree.
        self._book: ComponentBook | None = (
            ComponentBook(components, self.eviction_policy, page_size) if components else None
        )

    # ------------------------------------------------------------------ value bookkeeping
    # Every change of a node's values goes through these helpers, which keep the counters, the
    # parent's count of device children and the leaf sets up to date; component values go with them.

    def _set_device(self, node: TreeNode, value: torch.Tensor | None) -> None:
        old = node.device_value
        if value is None and old is not None and node.components is not None:
            assert self._book is not None
            self._book.drop_all(node, "device")
        n = len(node.key) >> 3
        delta = (value is not None) - (old is not None)
        node.device_value = value
        cached = node._path_indices
        if cached is not None:
            node._path_indices = None
            self._path_cache_tokens -= cached.numel()
        if delta:
            self._device_tokens += delta * n
            if node.host_value is not None and not node.host_lock and not node.device_lock:
                self._reclaimable_host -= delta * n
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
        if value is None and old is not None and node.components is not None:
            assert self._book is not None
            self._book.drop_all(node, "host")
        n = len(node.key) >> 3
        delta = (value is not None) - (old is not None)
        node.host_value = value
        if delta:
            self._host_tokens += delta * n
            if not node.host_lock:
                self._evictable_host += delta * n
                if node.device_value is None and not node.device_lock:
                    self._reclaimable_host += delta * n
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
        if node.components is not None:
            assert self._book is not None
            self._book.split(node, upper, tokens)

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
        nid = next(self._ids)
        upper = new_node(nid, parent, node.key[:nbytes], self._ctx, _new_ref(NodeRef, (self._serial, nid)))
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
        self._nodes[upper.id] = upper
        return upper

    def _new_node(self, parent: TreeNode, key: bytes) -> TreeNode:
        nid = next(self._ids)
        node = new_node(nid, parent, key, self._ctx, _new_ref(NodeRef, (self._serial, nid)))
        parent.children[key[: self._step]] = node
        self._nodes[node.id] = node
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
        del self._nodes[node.id]
        self._refresh(parent)

    def _take_frees(self) -> tuple[ComponentFree, ...]:
        """The component indices let go of by the operation that just ran (what its result carries)."""
        book = self._book
        return book.take_frees() if book is not None else ()

    # ------------------------------------------------------------------ walking and validation

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

    def _ref(self, node: TreeNode) -> NodeRef:
        """`node`'s handle (made with the node)."""
        return node._ref

    def _require_live(self, ref: object, name: str = "node") -> TreeNode:
        """The live node a handle names.

        Raises:
            TypeError: `ref` is not a `NodeRef`.
            ValueError: its node left the tree, or it is another tree's handle.
        """
        if type(ref) is NodeRef:
            node = self._nodes.get(ref.id) if ref.tree == self._serial else None
            if node is None:
                raise ValueError(f"{name}: {ref!r} is not a live node of this tree")
            return node
        raise TypeError(f"{name}: expected a NodeRef, got {type(ref).__name__}")

    def _require_non_root(self, node: object, name: str = "node") -> TreeNode:
        live = self._require_live(node, name)
        if live is self._root:
            raise ValueError(f"{name}: the root holds no pages")
        return live

    def _path(self, node: TreeNode) -> list[TreeNode]:
        """`node` and its ancestors below the root, deepest first."""
        path = []
        cur = node
        while cur is not self._root:
            path.append(cur)
            assert cur.parent is not None
            cur = cur.parent
        return path

    def _path_device_indices(self, node: TreeNode) -> torch.Tensor:
        """The device values of the root path ending at device node `node`, joined (cached on the node).

        The cache stays exact: `_set_device` drops a node's cache whenever its device value changes, an
        ancestor's value cannot change while a descendant is on the device (device prefix continuity),
        and a split keeps the lower part's root path. The caches hold at most twice the device tokens
        (deep chains would otherwise cost O(depth^2)).
        """
        cached = node._path_indices
        if cached is not None:
            return cached
        parts: list[torch.Tensor] = []
        cur = node
        while cur is not self._root:
            assert cur.device_value is not None
            assert cur.parent is not None
            parts.append(cur.device_value)
            cur = cur.parent
        parts.reverse()
        joined = cat_indices(parts)
        n = joined.numel()
        if len(parts) > 1 and self._path_cache_tokens + n <= 2 * self._device_tokens:
            node._path_indices = joined
            self._path_cache_tokens += n
        return joined

    # ------------------------------------------------------------------ observation

    def node_info(self, node: NodeRef) -> NodeInfo:
        """A snapshot of `node` (its tensors are the tree's: read, never write into them).

        Raises:
            TypeError, ValueError: `node` is not a handle on a live node of this tree.
        """
        live = self._require_live(node)
        parent = live.parent
        return NodeInfo(
            ref=self._ref(live),
            parent=None if parent is None else self._ref(parent),
            children=tuple(self._ref(c) for c in live.children.values()),
            key=live.key,
            num_tokens=len(live.key) >> 3,
            device_value=live.device_value,
            host_value=live.host_value,
            backup_pending=live.backup_pending,
            device_lock=live.device_lock,
            host_lock=live.host_lock,
            hit_count=live.hit_count,
            last_access=live.last_access,
            priority=live.priority,
        )

    def node_size(self, node: NodeRef) -> int:
        """Tokens `node` holds (`node_info(node).num_tokens`, without the snapshot: it is on the backup
        path, where a shared prefix's snapshot names its every child)."""
        return len(self._require_live(node).key) >> 3

    def parent_of(self, node: NodeRef) -> NodeRef | None:
        """`node`'s parent (`node_info(node).parent`, without the snapshot); None for the root."""
        parent = self._require_live(node).parent
        return None if parent is None else self._ref(parent)

    def device_value(self, node: NodeRef) -> torch.Tensor | None:
        """`node`'s own device indices, or None (`node_info(node).device_value`, without the snapshot)."""
        return self._require_live(node).device_value

    def is_backed_up(self, node: NodeRef) -> bool:
        """Whether `node` has a host copy (`node_info(node).host_value is not None`, without the
        snapshot)."""
        return self._require_live(node).host_value is not None

    def is_live(self, node: NodeRef) -> bool:
        """Whether `node` names a node still in this tree."""
        return type(node) is NodeRef and node.tree == self._serial and node.id in self._nodes

    @property
    def root(self) -> NodeRef:
        """The root's handle (the empty prefix; it holds no pages)."""
        return self._ref(self._root)

    def iter_nodes(self) -> list[NodeRef]:
        """Every node except the root, parents before children (O(tree): for tests and diagnostics)."""
        return [self._ref(n) for n in self._iter_nodes()]

    def held_indices(self) -> HeldIndices:
        """Every index the tree holds, per pool (O(tree): for the controller's ownership check)."""
        device: list[torch.Tensor] = []
        host: list[torch.Tensor] = []
        pending: list[torch.Tensor] = []
        comps: dict[tuple[str, str], list[torch.Tensor]] = {}
        for node in self._iter_nodes():
            for part, out in (
                (node.device_value, device),
                (node.host_value, host),
                (node.backup_pending, pending),
            ):
                if part is not None:
                    out.append(part)
            for name, data in (node.components or {}).items():
                for tier, part in (
                    ("device", data.device_value),
                    ("host", data.host_value),
                    ("pending", data.backup_pending),
                ):
                    if part is not None:
                        comps.setdefault((name, tier), []).append(part)
        return HeldIndices(
            tuple(device), tuple(host), tuple(pending), {key: tuple(v) for key, v in comps.items()}
        )

    def statistics(self) -> TreeStatistics:
        """A snapshot of the tree's sizes (O(1): the counters are kept incrementally)."""
        return TreeStatistics(
            num_nodes=len(self._nodes) - 1,  # every live node but the root
            device_tokens=self._device_tokens,
            host_tokens=self._host_tokens,
            pending_backup_tokens=self._pending_tokens,
            evictable_device_tokens=self._evictable_size,
            protected_device_tokens=self._protected_size,
            evictable_host_tokens=self._evictable_host,
            reclaimable_host_tokens=self._reclaimable_host,
        )

    def evictable_size(self) -> int:
        """Device tokens in nodes without a device lock."""
        return self._evictable_size

    def protected_size(self) -> int:
        """Device tokens in device-locked nodes."""
        return self._protected_size

    def reclaimable_host_size(self) -> int:
        """Host tokens `evict_host` can reclaim now (`statistics().reclaimable_host_tokens`)."""
        return self._reclaimable_host

    def _iter_nodes(self) -> list[TreeNode]:
        """Every node except the root, parents before children."""
        out: list[TreeNode] = []
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def device_tokens_owned(self) -> torch.Tensor:
        """Every device index the tree holds (O(tree): for exact pool accounting in tests)."""
        return cat_indices([n.device_value for n in self._iter_nodes() if n.device_value is not None])

    def host_tokens_owned(self) -> torch.Tensor:
        """Every host index the tree holds, pending backups included (O(tree): for pool accounting)."""
        parts = []
        for n in self._iter_nodes():
            if n.host_value is not None:
                parts.append(n.host_value)
            if n.backup_pending is not None:
                parts.append(n.backup_pending)
        return cat_indices(parts)

    # ------------------------------------------------------------------ the operations, one module per job

    # Matching and the queries that change nothing (`hicache.tree.matching`).
    match_prefix = matching.match_prefix
    peek = matching.peek
    node_at = matching.node_at
    depth = matching.depth
    page_hashes = matching.page_hashes
    last_hash = matching.last_hash
    device_indices = matching.device_indices
    stored_path = matching.stored_path
    # Inserting (`hicache.tree.inserting`).
    insert = inserting.insert
    insert_host = inserting.insert_host
    refill_backup_plan = inserting.refill_backup_plan
    # Backups, load-back of one node, demotion, locks and priority (`hicache.tree.backups`).
    backup_chain = backups.backup_chain
    begin_backup = backups.begin_backup
    commit_backup = backups.commit_backup
    abort_backup = backups.abort_backup
    attach_device = backups.attach_device
    demote = backups.demote
    lock_device = backups.lock_device
    unlock_device = backups.unlock_device
    lock_host = backups.lock_host
    unlock_host = backups.unlock_host
    set_priority = backups.set_priority
    # Load-back of a match and its failure (`hicache.tree.load_back`).
    attach_loaded = load_back.attach_loaded
    # Eviction planning (`hicache.tree.eviction`).
    evict_device = eviction.evict_device
    evict_host = eviction.evict_host
    evict_component = eviction.evict_component

    # ------------------------------------------------------------------ components

    @property
    def components(self) -> tuple[Component, ...]:
        """The tree's components in eviction order (lowest rank first); empty without components."""
        return self._book.components if self._book is not None else ()

    def component_value(self, node: NodeRef, name: str, tier: str = "device") -> torch.Tensor | None:
        """`node`'s value of component `name` on `tier` (`None` when it holds none there)."""
        live = self._require_live(node)
        if self._book is None:
            return None
        return self._book.value(live, name, tier)

    def component_info(self, node: NodeRef) -> dict[str, ComponentInfo]:
        """A snapshot of every component record `node` holds, by component name (empty without any).

        Raises:
            TypeError, ValueError: `node` is not a handle on a live node of this tree.
        """
        live = self._require_live(node)
        return {
            name: ComponentInfo(d.device_value, d.host_value, d.backup_pending, d.device_lock, d.host_lock)
            for name, d in (live.components or {}).items()
        }

    def component_window(self, node: NodeRef, tier: str = "device") -> dict[str, torch.Tensor]:
        """The component indices a prefix ending at `node` uses on `tier`, root-first per component.

        For each component whose `valid_end` holds there: the values it reads (sliding window: the
        window's suffix values; Mamba: the node's state). Empty entries are omitted.
        """
        live = self._require_live(node)
        if self._book is None or live is self._root:
            return {}
        return self._book.window(live, self._root, tier)

    def valid_end(self, node: NodeRef, tier: str | None = "device") -> bool:
        """Whether every component allows a prefix ending at `node` on `tier` (always without components).

        Tier `None` reads the device value on device nodes and the host value on the others: whether the
        prefix is valid once its host-only nodes are loaded back.
        """
        live = self._require_live(node)
        if self._book is None or live is self._root:
            return True
        return self._book.valid_end(live, self._root, tier)

    def component_statistics(self) -> dict[str, ComponentStatistics]:
        """Per component: slots on each tier and in backups in flight, and evictable nodes (O(1))."""
        return self._book.statistics() if self._book is not None else {}

    def component_indices_owned(self, name: str, tier: str) -> torch.Tensor:
        """Every index of component `name` on `tier` the tree holds (O(tree), for tests).

        Host indices of backups in flight are included on the host tier.
        """
        if self._book is None:
            return EMPTY_INDICES
        return self._book.indices_owned(self._iter_nodes(), name, check_tier(tier))

    # ------------------------------------------------------------------ observation

    def branches(self) -> list[BranchStatistics]:
        """Every top-level branch (a child of the root and its subtree), in the root's child order (O(tree):
        for diagnostics, such as the demo's table of the most hit prefixes)."""
        out = []
        for top in self._root.children.values():
            nodes = device = host = 0
            stack = [top]
            while stack:
                node = stack.pop()
                nodes += 1
                if node.device_value is not None:
                    device += node.num_tokens
                if node.host_value is not None:
                    host += node.num_tokens
                stack.extend(node.children.values())
            out.append(BranchStatistics(self._ref(top), top.key, top.hit_count, nodes, device, host))
        return out

    def sanity_check(self) -> None:
        """Check every invariant of the tree (O(tree)).

        Raises:
            InvariantViolation: listing every violated invariant.
        """
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


bind_tree(RadixTree, LeafSet, NodeRef, new_leaf, heapq.heappush)
