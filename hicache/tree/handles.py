"""What callers hold instead of tree nodes: opaque `NodeRef` handles, and read-only snapshots of what the
tree knows about a node (`NodeInfo`) and its components (`ComponentInfo`), a backed-up root path
(`StoredPath`) and every index it holds (`HeldIndices`). None of them can change the tree."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = ["ComponentInfo", "HeldIndices", "NodeInfo", "NodeRef", "StoredPath"]


class NodeRef(NamedTuple):
    """An opaque handle on one node of one tree; the tree resolves it on every call.

    Node ids are never reused within a tree, and `tree` tells trees apart, so a handle can never name
    another node: a handle whose node left the tree is rejected (`ValueError`), as is one from another
    tree. A split keeps the handle's node as the lower part, so a handle always ends where it ended.

    Attributes:
        tree: the serial number of the tree that issued it.
        id: the node's id in that tree (the root is 0).
    """

    tree: int
    id: int

    def __repr__(self) -> str:
        return f"NodeRef(tree={self.tree}, id={self.id})"


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """A snapshot of one node (`RadixTree.node_info`): its place, its values and its counters.

    The index tensors are the tree's own: read them, never write into them.

    Attributes:
        ref: the node's handle.
        parent: the parent's handle (`None` for the root).
        children: the children's handles.
        key: the node's tokens as little-endian int64 bytes (whole pages).
        num_tokens: tokens of the node's key.
        device_value: device pool indices, or `None` when not on the device.
        host_value: host pool indices, or `None` when not backed up.
        backup_pending: host indices of a backup in flight, else `None`.
        device_lock: device lock count.
        host_lock: host lock count.
        hit_count: inserts that touched the node.
        last_access: the tree's clock at the last match or insert that touched it.
        priority: the eviction priority.
    """

    ref: NodeRef
    parent: NodeRef | None
    children: tuple[NodeRef, ...]
    key: bytes
    num_tokens: int
    device_value: torch.Tensor | None
    host_value: torch.Tensor | None
    backup_pending: torch.Tensor | None
    device_lock: int
    host_lock: int
    hit_count: int
    last_access: int
    priority: int

    @property
    def backed_up(self) -> bool:
        """Whether the node has a host copy."""
        return self.host_value is not None

    @property
    def evicted(self) -> bool:
        """Whether the node's device copy is gone."""
        return self.device_value is None


@dataclass(frozen=True, slots=True)
class ComponentInfo:
    """A snapshot of one component's record on one node (`RadixTree.component_info`).

    The index tensors are the tree's own: read them, never write into them.

    Attributes:
        device_value: indices into the component's device pool, or `None` (absent or a tombstone).
        host_value: indices into the component's host pool, or `None`.
        backup_pending: host indices of a device-to-host backup in flight, else `None`.
        device_lock: holders protecting the device value from component eviction.
        host_lock: holders protecting the host value from component eviction.
    """

    device_value: torch.Tensor | None
    host_value: torch.Tensor | None
    backup_pending: torch.Tensor | None
    device_lock: int
    host_lock: int


@dataclass(frozen=True, slots=True)
class StoredPath:
    """The backed-up part of a root path (`RadixTree.stored_path`): what a storage write needs.

    Attributes:
        nodes: the leading backed-up nodes of the path, root-first (write-back: pages below an
            un-backed node cannot be found by prefix, so the path stops there).
        node_hashes: each node's page hashes.
        host_values: each node's host indices.
    """

    nodes: tuple[NodeRef, ...]
    node_hashes: tuple[tuple[bytes, ...], ...]
    host_values: tuple[torch.Tensor, ...]

    @property
    def hashes(self) -> list[bytes]:
        """Every page hash of the path, root-first."""
        return [h for hashes in self.node_hashes for h in hashes]


@dataclass(frozen=True, slots=True)
class HeldIndices:
    """Every index the tree holds, per pool (`RadixTree.held_indices`; O(tree), for ownership checks).

    Attributes:
        device: device values.
        host: host values.
        backup_pending: host indices of backups in flight.
        components: per `(component, tier)` with tier `"device"`, `"host"` or `"pending"`: the values.
    """

    device: tuple[torch.Tensor, ...]
    host: tuple[torch.Tensor, ...]
    backup_pending: tuple[torch.Tensor, ...]
    components: dict[tuple[str, str], tuple[torch.Tensor, ...]]
