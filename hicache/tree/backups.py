"""Backups and locks: device-to-host backups (begin, commit, abort), load-back and demotion, the device
and host locks that protect a path, and eviction priority."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hicache.policy import WritePolicy
from hicache.tree.checks import cat_indices, check_indices
from hicache.tree.node import TreeNode
from hicache.tree.state import TreeState

__all__ = ["BackupsAndLocks"]

_WB = WritePolicy.WRITE_BACK


class BackupsAndLocks(TreeState):
    """Backups, load-back, demotion, locks and priority (mixed into `RadixTree`)."""

    # ------------------------------------------------------------------ device -> host backups

    def backup_chain(self, node: TreeNode) -> list[TreeNode]:
        """The nodes to back up so that `node` can be backed up: from the topmost un-backed, not-pending
        ancestor down to `node`, root-first ([] if `node` is detached, backed up or pending)."""
        try:
            cur = self._require_non_root(node)
        except ValueError:
            return []
        chain: list[TreeNode] = []
        while cur is not self.root and cur.host_value is None and cur.backup_pending is None:
            chain.append(cur)
            assert cur.parent is not None
            cur = cur.parent
        chain.reverse()
        return chain

    def begin_backup(
        self,
        node: TreeNode,
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
        node = self._require_non_root(node)
        check_indices(host_indices, "host_indices", node.num_tokens)
        if node.device_value is None:
            raise ValueError(f"node: node {node.id} holds no device data to back up")
        if node.host_value is not None or node.backup_pending is not None:
            raise ValueError(f"node: node {node.id} is already backed up or has a backup in flight")
        if components:
            if self._book is None:
                raise ValueError("components: this tree has no components")
            self._book.check_backup(node, components)
        node.backup_pending = host_indices
        node._backup_owner = None
        self._pending_tokens += node.num_tokens
        if components:
            assert self._book is not None
            self._book.begin_backup(node, components)
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
            if member.components is not None:
                assert self._book is not None
                self._book.settle_backup(member, True)
        self.unlock_device(node)

    def abort_backup(self, node: TreeNode) -> torch.Tensor:
        """The backup of `node` failed or was cancelled: unlock and return its host indices to free.

        Component host indices of the backup are queued for `take_component_frees`.

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
            if member.components is not None:
                assert self._book is not None
                self._book.settle_backup(member, False)
        self.unlock_device(node)
        return cat_indices(parts)

    # ------------------------------------------------------------------ host -> device and demotion

    def attach_device(
        self,
        node: TreeNode,
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
        node = self._require_non_root(node)
        check_indices(device_indices, "device_indices", node.num_tokens)
        if node.device_value is not None or node.host_value is None:
            raise ValueError(f"node: node {node.id} is not host-only")
        parent = node.parent
        assert parent is not None
        if parent is not self.root and parent.device_value is None:
            raise ValueError(f"node: the parent {parent.id} of node {node.id} is not on the device")
        book = self._book
        if components:
            if book is None:
                raise ValueError("components: this tree has no components")
            book.check_attach(node, components)
        self._set_device(node, device_indices)
        if components:
            assert book is not None
            for name, value in components.items():
                book.set(node, name, "device", value)

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

    def lock_device(self, node: TreeNode) -> None:
        """Protect `node` and its ancestors from device eviction (counted; the root is excluded).

        Components are locked too: along the path, or only at `node` for those without `lock_path`.
        """
        path = self._path(node)
        for cur in path:
            cur.device_lock += 1
            if cur.device_lock == 1:
                if cur.device_value is not None:
                    n = cur.num_tokens
                    self._evictable_size -= n
                    self._protected_size += n
                elif cur.host_value is not None and not cur.host_lock:
                    self._reclaimable_host -= cur.num_tokens
                self._refresh(cur)
        if self._book is not None and path:
            self._book.lock(path, "device", 1)

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
                elif cur.host_value is not None and not cur.host_lock:
                    self._reclaimable_host += cur.num_tokens
                self._refresh(cur)
        if self._book is not None and path:
            self._book.lock(path, "device", -1)

    def lock_host(self, node: TreeNode) -> None:
        """Protect `node` and its ancestors from host eviction (counted; the root is excluded)."""
        path = self._path(node)
        for cur in path:
            cur.host_lock += 1
            if cur.host_lock == 1:
                if cur.host_value is not None:
                    self._evictable_host -= cur.num_tokens
                    if cur.device_value is None and not cur.device_lock:
                        self._reclaimable_host -= cur.num_tokens
                self._refresh(cur)
        if self._book is not None and path:
            self._book.lock(path, "host", 1)

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
                    if cur.device_value is None and not cur.device_lock:
                        self._reclaimable_host += cur.num_tokens
                self._refresh(cur)
        if self._book is not None and path:
            self._book.lock(path, "host", -1)

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
        if self._book is not None:
            for leaves in self._book.sets.values():
                if node in leaves:
                    leaves.push(node)
