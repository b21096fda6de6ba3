"""Backups and locks: device-to-host backups (begin, commit, abort), load-back and demotion, the device
and host locks that protect a path, and eviction priority."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from hicache.policy import WritePolicy
from hicache.tree.checks import cat_indices, check_indices
from hicache.tree.handles import NodeRef
from hicache.tree.node import TreeNode
from hicache.tree.results import FreeResult

if TYPE_CHECKING:
    from hicache.tree.radix import RadixTree

__all__ = [
    "abort_backup",
    "attach_device",
    "attach_device_value",
    "backup_chain",
    "begin_backup",
    "commit_backup",
    "demote",
    "lock_device",
    "lock_host",
    "set_priority",
    "unlock_device",
    "unlock_host",
]

_WB = WritePolicy.WRITE_BACK


# ------------------------------------------------------------------ device -> host backups


def backup_chain(tree: RadixTree, node: NodeRef) -> list[NodeRef]:
    """The nodes to back up so that `node` can be backed up: from the topmost un-backed, not-pending
    ancestor down to `node`, root-first ([] if `node` left the tree, is backed up or pending).

    Raises:
        TypeError: `node` is not a `NodeRef`.
    """
    try:
        cur = tree._require_non_root(node)
    except ValueError:
        return []
    chain: list[NodeRef] = []
    while cur is not tree._root and cur.host_value is None and cur.backup_pending is None:
        chain.append(tree._ref(cur))
        assert cur.parent is not None
        cur = cur.parent
    chain.reverse()
    return chain


def begin_backup(
    tree: RadixTree,
    node: NodeRef,
    host_indices: torch.Tensor,
    components: Mapping[str, torch.Tensor] | None = None,
) -> None:
    """Record a device-to-host backup of `node` in flight to `host_indices`; device-locks its path.

    Args:
        node: a device node that is neither backed up nor pending.
        host_indices: one host index per token of the node.
        components: host indices for the node's component device values, by name (each as long as
            the device value it copies); committed and aborted with the base backup.

    Raises:
        ValueError: the node holds no device data, is backed up or pending, or the indices mismatch.
    """
    live = tree._require_non_root(node)
    check_indices(host_indices, "host_indices", live.num_tokens)
    if live.device_value is None:
        raise ValueError(f"node: node {live.id} holds no device data to back up")
    if live.host_value is not None or live.backup_pending is not None:
        raise ValueError(f"node: node {live.id} is already backed up or has a backup in flight")
    if components:
        if tree._book is None:
            raise ValueError("components: this tree has no components")
        tree._book.check_backup(live, components)
    live.backup_pending = host_indices
    live._backup_owner = None
    tree._pending_tokens += live.num_tokens
    if components:
        assert tree._book is not None
        tree._book.begin_backup(live, components)
    _lock_device(tree, tree._path(live))


def _pending_group(tree: RadixTree, node: TreeNode) -> list[TreeNode]:
    """`node` and the upper parts split off it while its backup was in flight, root-first."""
    group = [node]
    cur = node.parent
    while cur is not None and cur._backup_owner is node and cur.backup_pending is not None:
        group.append(cur)
        cur = cur.parent
    group.reverse()
    return group


def commit_backup(tree: RadixTree, node: NodeRef) -> FreeResult:
    """The backup of `node` completed: its pending host indices become its host value; unlocks.

    Upper parts split off the node while the backup was in flight are committed with it. Returns the
    component host indices the commit let go of (a component value dropped while it was copied).

    Raises:
        ValueError: no backup in flight, or (except under write-back) the parent is neither the root
            nor backed up: chains are committed root-first.
    """
    live = tree._require_non_root(node)
    if live.backup_pending is None:
        raise ValueError(f"node: node {live.id} has no backup in flight")
    group = _pending_group(tree, live)
    top_parent = group[0].parent
    if tree.write_policy is not _WB and top_parent is not tree._root:
        assert top_parent is not None
        if top_parent.host_value is None:
            raise ValueError(
                f"node: cannot commit the backup of node {live.id} before its parent {top_parent.id} "
                "is backed up (commit chains root-first)"
            )
    for member in group:
        pending = member.backup_pending
        member.backup_pending = None
        member._backup_owner = None
        tree._pending_tokens -= member.num_tokens
        tree._set_host(member, pending)
        if member.components is not None:
            assert tree._book is not None
            tree._book.settle_backup(member, True)
    _unlock_device(tree, tree._path(live))
    return FreeResult(component_frees=tree._take_frees())


def abort_backup(tree: RadixTree, node: NodeRef) -> FreeResult:
    """The backup of `node` failed or was cancelled: unlock, and return its host indices (and its
    components') for the caller to free.

    Raises:
        ValueError: no backup in flight.
    """
    live = tree._require_non_root(node)
    if live.backup_pending is None:
        raise ValueError(f"node: node {live.id} has no backup in flight")
    parts = []
    for member in _pending_group(tree, live):
        pending = member.backup_pending
        assert pending is not None
        parts.append(pending)
        member.backup_pending = None
        member._backup_owner = None
        tree._pending_tokens -= member.num_tokens
        if member.components is not None:
            assert tree._book is not None
            tree._book.settle_backup(member, False)
    _unlock_device(tree, tree._path(live))
    return FreeResult(freed_host=cat_indices(parts), component_frees=tree._take_frees())


# ------------------------------------------------------------------ host -> device and demotion


def attach_device(
    tree: RadixTree,
    node: NodeRef,
    device_indices: torch.Tensor,
    components: Mapping[str, torch.Tensor] | None = None,
) -> None:
    """Record that a host-only node was loaded back to the device at `device_indices`.

    Args:
        node: a host-only node whose parent is on the device (or the root).
        device_indices: one device index per token of the node.
        components: device indices of component values loaded with it, by name (each as long as the
            node's host value of that component).

    Raises:
        ValueError: the node is not host-only, its parent is not on the device, or a length mismatch.
    """
    attach_device_value(tree, tree._require_non_root(node), device_indices, components)


def attach_device_value(
    tree: RadixTree,
    node: TreeNode,
    device_indices: torch.Tensor,
    components: Mapping[str, torch.Tensor] | None,
) -> None:
    check_indices(device_indices, "device_indices", node.num_tokens)
    if node.device_value is not None or node.host_value is None:
        raise ValueError(f"node: node {node.id} is not host-only")
    parent = node.parent
    assert parent is not None
    if parent is not tree._root and parent.device_value is None:
        raise ValueError(f"node: the parent {parent.id} of node {node.id} is not on the device")
    book = tree._book
    if components:
        if book is None:
            raise ValueError("components: this tree has no components")
        book.check_attach(node, components)
    tree._set_device(node, device_indices)
    if components:
        assert book is not None
        for name, value in components.items():
            book.set(node, name, "device", value)


def demote(tree: RadixTree, node: NodeRef) -> FreeResult:
    """Drop the device copy of a backed-up node and return its device indices (and its components')
    for the caller to free.

    Raises:
        ValueError: the node is not backed up, holds no device data, is device-locked, or has a child
            on the device.
    """
    live = tree._require_non_root(node)
    dv = live.device_value
    if dv is None:
        raise ValueError(f"node: node {live.id} holds no device data")
    if live.host_value is None:
        raise ValueError(f"node: node {live.id} is not backed up")
    if live.device_lock:
        raise ValueError(f"node: node {live.id} is device-locked")
    if live._dev_children:
        raise ValueError(f"node: node {live.id} has a child on the device")
    tree._set_device(live, None)
    return FreeResult(freed_device=dv, component_frees=tree._take_frees())


# ------------------------------------------------------------------ locks and priority


def lock_device(tree: RadixTree, node: NodeRef) -> None:
    """Protect `node` and its ancestors from device eviction (counted; the root is excluded).

    Components are locked too: along the path, or only at `node` for those without `lock_path`.
    """
    _lock_device(tree, tree._path(tree._require_live(node)))


def _lock_device(tree: RadixTree, path: list[TreeNode], delta: int = 1) -> None:
    """Add `delta` (+1 or -1) device locks along `path`, moving the tokens of nodes that become
    (un)locked between the counters."""
    edge = 1 if delta > 0 else 0  # the lock count at which a node changes sides
    for cur in path:
        cur.device_lock += delta
        if cur.device_lock == edge:
            n = cur.num_tokens * delta
            if cur.device_value is not None:
                tree._evictable_size -= n
                tree._protected_size += n
            elif cur.host_value is not None and not cur.host_lock:
                tree._reclaimable_host -= n
            tree._refresh(cur)
    if tree._book is not None and path:
        tree._book.lock(path, "device", delta)


def unlock_device(tree: RadixTree, node: NodeRef) -> None:
    """Release one device lock on `node` and its ancestors.

    Raises:
        ValueError: the node is not device-locked.
    """
    _unlock_device(tree, tree._path(tree._require_live(node)))


def _unlock_device(tree: RadixTree, path: list[TreeNode]) -> None:
    if path and path[0].device_lock <= 0:
        raise ValueError(f"node: node {path[0].id} is not device-locked")
    _lock_device(tree, path, -1)


def lock_host(tree: RadixTree, node: NodeRef) -> None:
    """Protect `node` and its ancestors from host eviction (counted; the root is excluded)."""
    _lock_host(tree, tree._path(tree._require_live(node)), 1)


def unlock_host(tree: RadixTree, node: NodeRef) -> None:
    """Release one host lock on `node` and its ancestors.

    Raises:
        ValueError: the node is not host-locked.
    """
    path = tree._path(tree._require_live(node))
    if path and path[0].host_lock <= 0:
        raise ValueError(f"node: node {path[0].id} is not host-locked")
    _lock_host(tree, path, -1)


def _lock_host(tree: RadixTree, path: list[TreeNode], delta: int) -> None:
    """Add `delta` (+1 or -1) host locks along `path` (as `_lock_device`, for the host counters)."""
    edge = 1 if delta > 0 else 0
    for cur in path:
        cur.host_lock += delta
        if cur.host_lock == edge:
            if cur.host_value is not None:
                n = cur.num_tokens * delta
                tree._evictable_host -= n
                if cur.device_value is None and not cur.device_lock:
                    tree._reclaimable_host -= n
            tree._refresh(cur)
    if tree._book is not None and path:
        tree._book.lock(path, "host", delta)


def set_priority(tree: RadixTree, node: NodeRef, priority: int) -> None:
    """Set the eviction priority of `node` (lower goes first under the priority policy)."""
    live = tree._require_non_root(node)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise TypeError(f"priority: expected an int, got {type(priority).__name__}")
    live.priority = priority
    if live in tree._device_leaves:
        tree._device_leaves.push(live)
    if live in tree._host_leaves:
        tree._host_leaves.push(live)
    if tree._book is not None:
        for leaves in tree._book.sets.values():
            if live in leaves:
                leaves.push(live)
