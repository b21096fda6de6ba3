"""Eviction planning: which device leaves to demote, drop or back up first (`evict_device`), which host
leaves to remove (`evict_host`), and which component values to let go of (`evict_component`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hicache.policy import WritePolicy
from hicache.tree.checks import cat_indices, check_count, check_tier
from hicache.tree.handles import NodeRef
from hicache.tree.node import TreeNode
from hicache.tree.results import ComponentEvictResult, EvictResult, HostEvictResult

if TYPE_CHECKING:
    from hicache.tree.radix import RadixTree

__all__ = ["evict_component", "evict_device", "evict_host"]

_WB = WritePolicy.WRITE_BACK


def evict_device(tree: RadixTree, num_tokens: int, host_free_tokens: int = 0) -> EvictResult:
    """Free at least `num_tokens` device tokens from evictable device leaves, in policy order.

    Three cases for each leaf: a backed-up leaf is demoted (its device pages freed); an un-backed
    one is deleted (write-through: nothing below it is backed up either), or under write-back
    backed up first when its whole un-backed chain fits in the host room left (`backups`), and
    dropped with its host-only subtree when it does not, so eviction never waits on a host too
    small for the backup. A host-locked un-backed leaf can be neither dropped nor deleted: it is
    backed up when its chain fits (write-back), else kept. Stops early (a value, not an error) when
    nothing more is evictable.

    Args:
        num_tokens: device tokens wanted.
        host_free_tokens: host tokens the caller can provide for write-back backups (free pages plus
            what `evict_host` can reclaim: `statistics().reclaimable_host_tokens`).

    Raises:
        TypeError, ValueError: a count that is not a non-negative int.
    """
    check_count(num_tokens, "num_tokens")
    room = check_count(host_free_tokens, "host_free_tokens")
    leaves = tree._device_leaves
    write_back = tree.write_policy is _WB
    root = tree._root
    freed_device: list[torch.Tensor] = []
    freed_host: list[torch.Tensor] = []
    backups: list[tuple[NodeRef, ...]] = []
    planned: set[TreeNode] = set()  # nodes of the chains in `backups`
    skipped: dict[TreeNode, None] = {}  # kept (pushed back at the end), in order
    got = dropped = 0
    while got < num_tokens:
        node = leaves.pop()
        if node is None:
            break
        if node in skipped:  # a second heap entry of a node kept earlier in this call
            continue
        n = len(node.key) >> 3
        dv = node.device_value
        assert dv is not None
        if node.host_value is not None:
            tree._set_device(node, None)
            freed_device.append(dv)
            got += n
            continue
        if write_back:
            # What the backup really needs: the whole un-backed chain above the leaf, less what an
            # earlier chain of this plan already backs up.
            chain: list[TreeNode] = []
            cost = 0
            cur = node
            while (
                cur is not root
                and cur.host_value is None
                and cur.backup_pending is None
                and cur not in planned
            ):
                chain.append(cur)
                cost += len(cur.key) >> 3
                if cost > room:
                    break
                assert cur.parent is not None
                cur = cur.parent
            if cost <= room:
                room -= cost
                chain.reverse()
                planned.update(chain)
                backups.append(tuple(tree._ref(n) for n in chain))
                skipped[node] = None
                got += n
                continue
        if node.host_lock:  # dropping would take host-locked pages with it
            skipped[node] = None
        elif write_back:
            _drop_subtree(tree, node, freed_device, freed_host)
            got += n
            dropped += n
        elif not node.children:
            tree._detach(node)
            freed_device.append(dv)
            got += n
            dropped += n
        else:  # excluded by the write-through invariant (no backed-up child of an un-backed node)
            skipped[node] = None
    for node in skipped:
        leaves.push(node)
    backup_tokens = host_free_tokens - room
    return EvictResult(
        cat_indices(freed_device),
        cat_indices(freed_host),
        got,
        tuple(backups),
        backup_tokens,
        dropped,
        tree._take_frees(),
    )


def _drop_subtree(
    tree: RadixTree, node: TreeNode, freed_device: list[torch.Tensor], freed_host: list[torch.Tensor]
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
        tree._detach(cur)


def evict_host(tree: RadixTree, num_tokens: int) -> HostEvictResult:
    """Free at least `num_tokens` host tokens by removing host-only leaves in policy order.

    Stops early (a value, not an error) when nothing more is evictable.

    Raises:
        TypeError, ValueError: a count that is not a non-negative int.
    """
    check_count(num_tokens, "num_tokens")
    leaves = tree._host_leaves
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
        tree._detach(node)
    return HostEvictResult(cat_indices(freed), got, tree._take_frees())


def evict_component(tree: RadixTree, name: str, num_slots: int, tier: str = "device") -> ComponentEvictResult:
    """Free at least `num_slots` slots of component `name` on `tier` while the nodes stay.

    Unlocked values go in policy order; each also drops the higher-ranked components of its node
    (a sliding-window tombstone drops the node's Mamba state). Stops early (a value, not an error)
    when nothing more is evictable.

    Raises:
        ValueError: an unknown component or tier; TypeError: a count that is not an int.
    """
    book = tree._book
    comp = None if book is None else book.index.get(name)
    if comp is None:
        raise ValueError(f"name: unknown component {name!r}")
    check_tier(tier)
    check_count(num_slots, "num_slots")
    assert book is not None
    leaves = book.sets[(name, tier)]
    got = 0
    while got < num_slots:
        node = leaves.pop()
        if node is None:
            break
        got += book.drop_cascade(node, comp, tier)
    return ComponentEvictResult(got, tree._take_frees())
