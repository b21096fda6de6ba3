"""`sanity_check()`: every invariant of the tree recomputed from scratch, every violation reported."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hicache.errors import InvariantViolation
from hicache.keys import chained_page_hashes
from hicache.policy import WritePolicy

if TYPE_CHECKING:
    from hicache.tree.component_book import ComponentBook
    from hicache.tree.node import TreeNode
    from hicache.tree.radix import RadixTree

__all__ = ["check_tree", "collect_violations"]


def _check_value(node: TreeNode, name: str, value: torch.Tensor | None, out: list[str]) -> None:
    if value is None:
        return
    if value.dtype != torch.int64 or value.dim() != 1:
        out.append(f"node {node.id}: {name} is not a 1-D int64 tensor ({value.dtype}, {tuple(value.shape)})")
    elif value.shape[0] != node.num_tokens:
        out.append(f"node {node.id}: {name} has {value.shape[0]} entries for {node.num_tokens} tokens")


def collect_violations(tree: RadixTree) -> list[str]:
    """Every violated invariant of `tree`, one line each (empty when the tree is sound)."""
    out: list[str] = []
    root = tree._root
    step = tree.page_size * 8
    write_back = tree.write_policy is WritePolicy.WRITE_BACK
    if root.key != b"" or root.parent is not None:
        out.append("root: must have an empty key and no parent")
    if root.device_value is not None or root.host_value is not None or root.backup_pending is not None:
        out.append("root: must hold no values")
    if root.device_lock or root.host_lock:
        out.append("root: must hold no locks")
    if root.components:
        out.append("root: must hold no component data")
    comp_check = _ComponentCheck(tree._book) if tree._book is not None else None

    device_leaves: set[TreeNode] = set()
    host_leaves: set[TreeNode] = set()
    num_nodes = device = host = pending = evictable = protected = evictable_host = reclaimable_host = (
        path_cache
    ) = 0
    stack = [root]
    reachable: set[int] = set()
    while stack:
        node = stack.pop()
        reachable.add(node.id)
        if tree._nodes.get(node.id) is not node:
            out.append(f"node {node.id}: not registered under its id (its handles would not resolve)")
        dev_children = 0
        for k, child in node.children.items():
            stack.append(child)
            if child.parent is not node:
                out.append(f"node {child.id}: parent link does not point to node {node.id}")
            if not child.key or len(child.key) % step:
                out.append(
                    f"node {child.id}: key of {len(child.key)} bytes is not a positive number of pages"
                )
            if k != child.key[:step]:
                out.append(f"node {node.id}: child {child.id} is filed under a key other than its first page")
            if child.device_value is not None:
                dev_children += 1
        if node._dev_children != dev_children:
            out.append(f"node {node.id}: counts {node._dev_children} device children, has {dev_children}")
        if node is root:
            continue
        num_nodes += 1
        n = node.num_tokens
        parent = node.parent
        assert parent is not None
        dv, hv, pv = node.device_value, node.host_value, node.backup_pending
        if dv is None and hv is None and pv is None:
            out.append(f"node {node.id}: holds data on no tier")
        _check_value(node, "device_value", dv, out)
        _check_value(node, "host_value", hv, out)
        _check_value(node, "backup_pending", pv, out)
        try:
            hashes = node.hashes
            expected = chained_page_hashes(node.key, tree.page_size, tree.namespace, parent.last_hash)
            if len(hashes) != n // tree.page_size:
                out.append(f"node {node.id}: {len(hashes)} hashes for {n // tree.page_size} pages")
            elif hashes != expected:
                out.append(f"node {node.id}: page hashes are not chained from its parent's last hash")
        except ValueError as exc:
            out.append(f"node {node.id}: {exc}")
        if dv is not None and parent is not root and parent.device_value is None:
            out.append(f"node {node.id}: on the device but its parent {parent.id} is not")
        if not write_back and hv is not None and parent is not root and parent.host_value is None:
            out.append(f"node {node.id}: backed up but its parent {parent.id} is not")
        if pv is not None:
            if dv is None:
                out.append(f"node {node.id}: backup pending without device data")
            if hv is not None:
                out.append(f"node {node.id}: backup pending although already backed up")
            if node.device_lock < 1:
                out.append(f"node {node.id}: backup pending but not device-locked")
        if node.device_lock < 0 or node.host_lock < 0:
            out.append(f"node {node.id}: negative lock count ({node.device_lock}, {node.host_lock})")
        if parent is not root:
            if parent.device_lock < node.device_lock:
                out.append(f"node {node.id}: device lock {node.device_lock} exceeds its parent's")
            if parent.host_lock < node.host_lock:
                out.append(f"node {node.id}: host lock {node.host_lock} exceeds its parent's")
        if node.last_access > tree._clock:
            out.append(f"node {node.id}: last_access {node.last_access} is ahead of the clock")
        if dv is not None:
            device += n
            if node.device_lock:
                protected += n
            else:
                evictable += n
            if not dev_children and not node.device_lock and pv is None:
                device_leaves.add(node)
        elif hv is not None and not node.children and not node.host_lock and not node.device_lock:
            host_leaves.add(node)
        if hv is not None:
            host += n
            if not node.host_lock:
                evictable_host += n
                if dv is None and not node.device_lock:
                    reclaimable_host += n
        if pv is not None:
            pending += n
        if node._path_indices is not None:
            path_cache += node._path_indices.numel()
            _check_path_cache(node, out)
        if node.components is not None:
            if comp_check is None:
                out.append(f"node {node.id}: holds component data in a tree without components")
            else:
                comp_check.visit(node, out)

    if comp_check is not None:
        comp_check.finish(out)
    stale = sorted(set(tree._nodes) - reachable)
    if stale:
        out.append(f"handles of removed nodes still resolve: {stale}")
    for name, actual, expected_set in (
        ("device", tree._device_leaves, device_leaves),
        ("host", tree._host_leaves, host_leaves),
    ):
        extra = sorted(x.id for x in actual.members - expected_set)
        missing = sorted(x.id for x in expected_set - actual.members)
        if extra or missing:
            out.append(f"{name} leaf set: extra {extra}, missing {missing}")
        out.extend(f"{name} leaf set: {v}" for v in actual.check())
    stats = tree.statistics()
    for name, kept, recomputed in (
        ("num_nodes", stats.num_nodes, num_nodes),
        ("device_tokens", stats.device_tokens, device),
        ("host_tokens", stats.host_tokens, host),
        ("pending_backup_tokens", stats.pending_backup_tokens, pending),
        ("evictable_device_tokens", stats.evictable_device_tokens, evictable),
        ("protected_device_tokens", stats.protected_device_tokens, protected),
        ("evictable_host_tokens", stats.evictable_host_tokens, evictable_host),
        ("reclaimable_host_tokens", stats.reclaimable_host_tokens, reclaimable_host),
        ("path_cache_tokens", tree._path_cache_tokens, path_cache),
    ):
        if kept != recomputed:
            out.append(f"counter {name}: kept {kept}, recomputed {recomputed}")
    return out


def _check_path_cache(node: TreeNode, out: list[str]) -> None:
    """A node's cached joined root path equals the join of the device values on its path."""
    cached = node._path_indices
    assert cached is not None
    parts: list[torch.Tensor] = []
    cur: TreeNode | None = node
    while cur is not None and cur.parent is not None:
        if cur.device_value is None:
            out.append(f"node {node.id}: caches its joined root path but node {cur.id} is not on the device")
            return
        parts.append(cur.device_value)
        cur = cur.parent
    parts.reverse()
    if not torch.equal(cached, torch.cat(parts)):
        out.append(f"node {node.id}: cached joined root path differs from its path's device values")


def check_tree(tree: RadixTree) -> None:
    """Raise `InvariantViolation` listing every violated invariant of `tree`."""
    violations = collect_violations(tree)
    if violations:
        raise InvariantViolation(violations)


class _ComponentCheck:
    """The component invariants, gathered node by node and compared with the tree's counters at the end."""

    def __init__(self, book: ComponentBook) -> None:
        self.book = book
        self.slots = {c.name: [0, 0, 0] for c in book.components}
        self.members: dict[tuple[str, str], set[TreeNode]] = {key: set() for key in book.sets}

    def visit(self, node: TreeNode, out: list[str]) -> None:
        book = self.book
        comps = node.components
        assert comps is not None
        n = node.num_tokens
        for name, data in comps.items():
            comp = book.index.get(name)
            if comp is None:
                out.append(f"node {node.id}: data of unknown component {name!r}")
                continue
            counts = self.slots[name]
            for attr, base, i in (
                ("device_value", node.device_value, 0),
                ("host_value", node.host_value, 1),
                ("backup_pending", node.backup_pending, 2),
            ):
                value = getattr(data, attr)
                if value is None:
                    continue
                if value.dtype != torch.int64 or value.dim() != 1:
                    out.append(f"node {node.id}: {name}.{attr} is not a 1-D int64 tensor")
                    continue
                problem = comp.check_value(value, n, book.page_size)
                if problem is not None:
                    out.append(f"node {node.id}: {name}.{attr}: {problem}")
                if base is None:
                    out.append(f"node {node.id}: {name}.{attr} without the base value on that tier")
                counts[i] += int(value.shape[0])
            if data.backup_pending is not None:
                if data.device_value is None:
                    out.append(f"node {node.id}: {name} backup pending without a {name} device value")
                elif data.backup_pending.shape != data.device_value.shape:
                    out.append(f"node {node.id}: {name} backup pending does not match its device value")
                if data.host_value is not None:
                    out.append(f"node {node.id}: {name} backup pending although already on the host")
            if data.device_lock < 0 or data.host_lock < 0:
                out.append(f"node {node.id}: negative {name} lock ({data.device_lock}, {data.host_lock})")
            if data.device_lock > node.device_lock:
                out.append(
                    f"node {node.id}: {name} device lock {data.device_lock} exceeds the base lock "
                    f"{node.device_lock}"
                )
            if data.host_lock > node.host_lock:
                out.append(
                    f"node {node.id}: {name} host lock {data.host_lock} exceeds the base lock {node.host_lock}"
                )
            if data.device_value is not None and not data.device_lock and data.backup_pending is None:
                self.members[(name, "device")].add(node)
            if data.host_value is not None and not data.host_lock:
                self.members[(name, "host")].add(node)

    def finish(self, out: list[str]) -> None:
        book = self.book
        for key, expected in self.members.items():
            actual = book.sets[key]
            extra = sorted(x.id for x in actual.members - expected)
            missing = sorted(x.id for x in expected - actual.members)
            if extra or missing:
                out.append(f"{key[0]} {key[1]} evictable set: extra {extra}, missing {missing}")
            out.extend(f"{key[0]} {key[1]} evictable set: {v}" for v in actual.check())
        for name, recomputed in self.slots.items():
            slots = book.slots[name]
            kept = (slots.device, slots.host, slots.pending)
            for label, a, b in zip(("device", "host", "pending"), kept, recomputed, strict=True):
                if a != b:
                    out.append(f"counter {name} {label} slots: kept {a}, recomputed {b}")
        if book.frees:
            out.append(f"{len(book.frees)} component frees were not handed to any caller")
