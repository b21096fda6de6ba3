"""The node of the radix tree: a run of whole pages with its values on each tier (tree-internal records).

Only the tree reads and writes these; callers hold `NodeRef` handles the tree resolves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from hicache.keys import ROOT_HASH, TOKEN_BYTES, Namespace, chained_page_hashes
from hicache.tree.handles import NodeRef

try:
    import _hicache_tree
except ImportError as exc:  # pragma: no cover - only on an install that skipped the build
    raise ImportError(
        f"{exc}: hicache's C extension _hicache_tree (native/hicache_tree.c, the tree's walk) is not built; "
        "build it with `make native`, `pip install -e .` or `python setup.py build_ext --inplace`"
    ) from exc

__all__ = [
    "ComponentData",
    "TreeNode",
    "add_leaf",
    "all_hashes",
    "bind_tree",
    "copy_indices",
    "join_indices",
    "maker",
    "new_leaf",
    "new_node",
    "page_runs",
    "walk",
]

_WALK_BUILD = 6
if getattr(_hicache_tree, "BUILD", 0) != _WALK_BUILD:  # pragma: no cover - only on a stale build
    raise ImportError(
        f"hicache's C extension _hicache_tree ({_hicache_tree.__file__}) is stale: built from an older "
        f"native/hicache_tree.c (build {getattr(_hicache_tree, 'BUILD', 0)}, this code needs {_WALK_BUILD}); "
        "rebuild it with `make native`"
    )


class ComponentData:
    """One component's state on one node: a value per tier, an in-flight backup, and lock counts.

    Attributes:
        device_value: indices into the component's device pool, or `None` (absent or a tombstone).
        host_value: indices into the component's host pool, or `None`.
        backup_pending: host indices of a device-to-host backup in flight, else `None`.
        device_lock: holders protecting the device value from component eviction.
        host_lock: holders protecting the host value from component eviction.
    """

    __slots__ = ("backup_pending", "device_lock", "device_value", "host_lock", "host_value")

    def __init__(self) -> None:
        self.device_value: torch.Tensor | None = None
        self.host_value: torch.Tensor | None = None
        self.backup_pending: torch.Tensor | None = None
        self.device_lock = 0
        self.host_lock = 0

    def value(self, tier: str) -> torch.Tensor | None:
        """The value on `tier` (`"device"` or `"host"`)."""
        return self.device_value if tier == "device" else self.host_value

    @property
    def empty(self) -> bool:
        """No value, no backup in flight and no lock: the record can be dropped."""
        return (
            self.device_value is None
            and self.host_value is None
            and self.backup_pending is None
            and not self.device_lock
            and not self.host_lock
        )

    def __repr__(self) -> str:
        def size(v: torch.Tensor | None) -> str:
            return "-" if v is None else str(int(v.numel()))

        return (
            f"ComponentData(device={size(self.device_value)}, host={size(self.host_value)}, "
            f"pending={size(self.backup_pending)}, locks=({self.device_lock}, {self.host_lock}))"
        )


class TreeNode:
    """One edge of the radix tree: `key` (whole pages of int64 token bytes) and its values on each tier.

    Attributes:
        id: a number unique within the tree (the root is 0).
        parent: the parent node; `None` for the root and for nodes removed from the tree.
        children: children keyed by the bytes of their first page.
        key: the node's tokens as little-endian int64 bytes, a whole number of pages.
        device_value: device pool indices, one per token, or `None` once evicted from the device.
        host_value: host pool indices, one per token, or `None` while not backed up.
        backup_pending: host indices of a device-to-host backup in flight, else `None`.
        device_lock: how many holders protect this node (or a descendant) from device eviction.
        host_lock: how many holders protect this node (or a descendant) from host eviction.
        hit_count: how many inserts touched this node (drives selective write-through and LFU).
        last_access: the tree's logical clock at the last match or insert that touched this node.
        priority: the eviction priority (lower goes first under the priority policy).
        components: per-component data (sliding-window KV, Mamba state) by component name; `None` in a
            tree without components and until the node first holds or locks one.
    """

    __slots__ = (
        "_backup_owner",
        "_ctx",
        "_dev_children",
        "_hashes",
        "_path_indices",
        "_ref",
        "backup_pending",
        "children",
        "components",
        "device_lock",
        "device_value",
        "hit_count",
        "host_lock",
        "host_value",
        "id",
        "key",
        "last_access",
        "parent",
        "priority",
    )

    id: int
    parent: TreeNode | None
    children: dict[bytes, TreeNode]
    key: bytes
    device_value: torch.Tensor | None
    host_value: torch.Tensor | None
    backup_pending: torch.Tensor | None
    device_lock: int
    host_lock: int
    hit_count: int
    last_access: int
    priority: int
    components: dict[str, ComponentData] | None
    # Private bookkeeping kept by the tree: the number of children holding device data; the page hashes
    # (computed lazily: they depend only on the tokens from the root, so they never go stale); the tree's
    # (page_size, namespace), shared by every node; for the upper part of a node split while its backup
    # was in flight, the node the controller began the backup on; the joined device values of the whole
    # root path, cached by a match that joined them and dropped whenever this node's device value changes
    # (see `RadixTree._path_device_indices`); and the node's handle, made with it.
    _dev_children: int
    _hashes: list[bytes] | None
    _ctx: tuple[int, Namespace]
    _backup_owner: TreeNode | None
    _path_indices: torch.Tensor | None
    _ref: NodeRef

    @property
    def num_tokens(self) -> int:
        """Number of tokens in the node's key."""
        return len(self.key) // TOKEN_BYTES

    @property
    def hashes(self) -> list[bytes]:
        """One chained 16-byte hash per page, continuing from the parent's last hash.

        Raises:
            ValueError: if the hashes were never computed and the node was removed from its tree.
        """
        h = self._hashes
        if h is None:
            h = self._compute_hashes()
        return h

    @hashes.setter
    def hashes(self, value: list[bytes]) -> None:
        self._hashes = value

    def _compute_hashes(self) -> list[bytes]:
        parent = self.parent
        if parent is None:
            if self.key:
                raise ValueError(f"node {self.id} was removed from its tree before its hashes were computed")
            return []
        page_size, ns = self._ctx
        h = chained_page_hashes(self.key, page_size, ns, parent.last_hash)
        self._hashes = h
        return h

    @property
    def last_hash(self) -> bytes:
        """The hash of the node's last page (`ROOT_HASH` for the root)."""
        if not self.key:
            return ROOT_HASH
        return self.hashes[-1]

    def __repr__(self) -> str:
        tiers = []
        if self.device_value is not None:
            tiers.append("device")
        if self.host_value is not None:
            tiers.append("host")
        if self.backup_pending is not None:
            tiers.append("backup-pending")
        if self.components:
            for name, data in self.components.items():
                if data.device_value is not None:
                    tiers.append(f"{name}@device")
                if data.host_value is not None:
                    tiers.append(f"{name}@host")
        return (
            f"TreeNode(id={self.id}, tokens={self.num_tokens}, tiers={'+'.join(tiers) or 'none'}, "
            f"children={len(self.children)}, device_lock={self.device_lock}, host_lock={self.host_lock}, "
            f"hits={self.hit_count}, last_access={self.last_access}, priority={self.priority})"
        )


_hicache_tree.bind(TreeNode, np.empty, np.int64, torch.from_numpy)
maker = _hicache_tree.maker
"""`maker(cls, fields, defaults)`: a C constructor of a `__slots__` class that skips `__init__` (the tree's
records on the hot path: nodes, `MatchResult`, `InsertResult`)."""

_NODE_DEFAULTS: dict[str, object] = {
    "children": dict,  # a fresh dict per node
    "device_value": None,
    "host_value": None,
    "backup_pending": None,
    "device_lock": 0,
    "host_lock": 0,
    "hit_count": 0,
    "last_access": 0,
    "priority": 0,
    "components": None,
    "_dev_children": 0,
    "_hashes": None,
    "_backup_owner": None,
    "_path_indices": None,
}
new_node: Callable[[int, TreeNode | None, bytes, tuple[int, Namespace], NodeRef], TreeNode] = (
    _hicache_tree.maker(TreeNode, ("id", "parent", "key", "_ctx", "_ref"), _NODE_DEFAULTS)
)
"""`new_node(id, parent, key, ctx, ref)`: a node holding nothing yet (made in C, without a Python `__init__`:
it is on the insert path)."""
_LEAF_FIELDS = ("id", "parent", "key", "_ctx", "_ref", "device_value", "last_access", "hit_count")
new_leaf: Callable[
    [int, TreeNode, bytes, tuple[int, Namespace], NodeRef, torch.Tensor, int, int], TreeNode
] = _hicache_tree.maker(
    TreeNode, _LEAF_FIELDS, {k: v for k, v in _NODE_DEFAULTS.items() if k not in _LEAF_FIELDS}
)
"""`new_leaf(id, parent, key, ctx, ref, device_value, last_access, hit_count)`: an insert's new device leaf
(as `new_node`, with the three slots an insert sets filled by the maker)."""
walk: Callable[
    [TreeNode, bytes, int, int, int, TreeNode, list[torch.Tensor] | None, list[NodeRef] | None, int],
    tuple[int, TreeNode, TreeNode, TreeNode | None, int],
] = _hicache_tree.walk
"""`walk(node, key, pos, step, tick, last_host, values, backups, backup_hits)`: follow page-aligned key bytes
from byte `pos` below `node` through the children the key covers whole and that hold device data, in C
(native/hicache_tree.c has the contract). Returns `(pos, node, last_host, stop, matched)`: where it ended,
and the child it stopped before (matched in part, or not on the device) with the key bytes of it that
match, or `None`."""

add_leaf: Callable[..., TreeNode] = _hicache_tree.add_leaf
"""`add_leaf(tree, parent, key, pos, value, tick, backups, backup_hits)`: an insert's new device leaf, made and
counted in C (native/hicache_tree.c has the contract; `RadixTree` binds its slots with `bind_tree`)."""
all_hashes: Callable[[list[bytes]], bool] = _hicache_tree.all_hashes
"""`all_hashes(hashes)`: whether every item of the list is a bytes object of 16 bytes (in C: one pass)."""
bind_tree: Callable[..., None] = _hicache_tree.bind_tree
"""`bind_tree(tree_class, leaf_set_class, ref_class, leaf_maker, heappush)`: what `add_leaf` needs (once)."""

_copy_out = _hicache_tree.copy_out
_join = _hicache_tree.join
page_runs: Callable[[object, object, int, int], int] = _hicache_tree.page_runs
"""`page_runs(tokens, out, page_size, num_pages)`: check that int64 token indices are whole page runs of a
pool of `num_pages` pages, their page ids into `out`; 0, or 1 (length), 2 (misaligned), 3 (out of range).
In C with the tree's natives: a pool allocator validates every index tensor it is handed back with it."""


def copy_indices(src: torch.Tensor, start: int, n: int) -> torch.Tensor:
    """The tree's own copy of `src[start:start + n]` (a 1-D int64 tensor the caller checked).

    On the CPU the copy is numpy memory filled in C (`_hicache_tree.copy_out`: one call) and viewed as a
    tensor, cheaper than `narrow_copy` (a torch op costs 8-12k instructions, about a quarter of an insert);
    elsewhere (a CUDA tensor, a strided one) it is `narrow_copy`.
    """
    if src.is_cpu and src.is_contiguous():
        out: torch.Tensor = _copy_out(src.data_ptr() + 8 * start, n)
        return out
    return src.narrow_copy(0, start, n)


def join_indices(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """`torch.cat(parts)` of 1-D int64 tensors, into numpy memory filled in C when all are contiguous on the
    CPU (`_hicache_tree.join`, one call: a match's joined device indices, one join per first match of a
    path)."""
    out: torch.Tensor | None = _join(parts)
    return torch.cat(list(parts)) if out is None else out
