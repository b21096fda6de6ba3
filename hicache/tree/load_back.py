"""Load-back: attaching pages copied from the host back to the device to the nodes that cover them now."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from hicache.keys import TOKEN_BYTES, KeyLike
from hicache.tree import backups, matching
from hicache.tree.checks import cat_indices
from hicache.tree.handles import NodeRef
from hicache.tree.node import TreeNode
from hicache.tree.results import ComponentFree, FreeResult, LoadResult

if TYPE_CHECKING:
    from hicache.tree.radix import RadixTree

__all__ = ["LoadedComponents", "attach_loaded", "clear_poison", "drop_failed_load", "poison_load", "poisoned"]

LoadedComponents = Mapping[tuple[NodeRef, str], tuple[torch.Tensor, torch.Tensor]]
"""Per (host node of the match, component name): (the host value copied, its device copy)."""


def attach_loaded(
    tree: RadixTree,
    key: KeyLike,
    start: int,
    device_indices: torch.Tensor,
    components: LoadedComponents | None = None,
) -> LoadResult:
    """Attach device copies of host pages for tokens [start, start + n) of `key` to the nodes covering
    them now, and match `key` again.

    The tree may have changed while the copy ran (splits, a concurrent load of the same nodes,
    eviction): the span is matched again, pages of nodes already on the device again are duplicates,
    pages beyond where the match now ends are not taken, and a component copy is taken only if its
    node still holds the host value it was copied from. What no node takes is returned to be freed.

    Args:
        key: the request's token key (the load-back's match key).
        start: the first loaded token (the match's device length when the copy began).
        device_indices: the device copies, one index per loaded token.
        components: per (host node of the match, component name): (the host value copied, its device
            copy); the tree takes ownership of every copy.

    Raises:
        TypeError, ValueError: a malformed key, a negative `start`, indices that are not a 1-D int64
            tensor, or a span beyond the page-aligned key.
    """
    kb, _ = tree._aligned_key(key)
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"start: expected an int >= 0, got {start!r}")
    if not isinstance(device_indices, torch.Tensor) or device_indices.dtype != torch.int64:
        raise TypeError("device_indices: expected a 1-D int64 tensor")
    if device_indices.dim() != 1:
        raise ValueError(f"device_indices: expected a 1-D tensor, got shape {tuple(device_indices.shape)}")
    end = start + int(device_indices.numel())
    if end * TOKEN_BYTES > len(kb):
        raise ValueError(f"device_indices: tokens [{start}, {end}) reach beyond the page-aligned key")
    pending = {(node.id, name): entry for (node, name), entry in (components or {}).items()}
    frees: list[ComponentFree] = []
    freed: list[torch.Tensor] = []
    # One walk of the whole key, split at the span's end: the span's nodes as a match of the key cut
    # there finds them, then (after the attach) the key's fresh match, from the same walk.
    path = matching.walk_key(tree, kb, end * TOKEN_BYTES)
    upto, tokens = 0, 0
    while upto < len(path) and tokens < end:
        tokens += path[upto].num_tokens
        upto += 1
    i, k, j = matching.match_bounds(tree, path[:upto])
    offset = sum(n.num_tokens for n in path[:i])
    if min(end, offset) > start:
        freed.append(device_indices[: min(end, offset) - start])
    book = tree._book
    names = [c.name for c in book.components] if book is not None else []
    for node in path[k : k + j]:
        node_end = offset + node.num_tokens
        assert node_end <= end, "the walk splits the node across the span's end"
        if offset >= start:
            comps: dict[str, torch.Tensor] = {}
            for comp in names:
                entry = pending.pop((node.id, comp), None)
                if entry is None:
                    continue
                # The host value may have been split meanwhile: take the copy only if it still fits.
                assert book is not None
                if book.value(node, comp, "host") is entry[0]:
                    comps[comp] = entry[1]
                else:
                    frees.append(ComponentFree(comp, "device", entry[1]))
            backups.attach_device_value(
                tree, node, device_indices[offset - start : node_end - start], comps or None
            )
        offset = node_end
    if offset < end:
        # A tail not attached: nodes loaded meanwhile by another request, or beyond where the match now
        # ends (a component's valid end moved; it may end before `start`, on the device part).
        freed.append(device_indices[max(offset, start) - start :])
    frees.extend(ComponentFree(name, "device", copy) for (_, name), (_, copy) in pending.items())
    match = matching.match_of_walk(tree, kb, path)
    return LoadResult(match, cat_indices(freed), (*frees, *tree._take_frees()))


def drop_failed_load(
    tree: RadixTree, key: KeyLike, start: int, device_indices: torch.Tensor
) -> tuple[FreeResult, tuple[NodeRef, ...]]:
    """Take the pages of a load-back whose copy failed out of the device tier, locked or not.

    `attach_loaded` attached `device_indices` (tokens [start, start + n) of `key`) before their copy
    landed; it failed, so they hold bytes that are no node's KV. Every node of the path whose device
    value is one of them loses it (its host copy, what the load read, stays), and so does every device
    node below the shallowest of them (device prefix continuity): backed-up ones lose their device
    value, device-only ones without children, locks or backup leave the tree. Locks stay where they
    are (a lease on a node that lost its device value releases it as before). A node kept below
    (device-only and locked, or with a backup in flight or a host-only child) keeps its ancestors on
    the device too: those failed nodes are poisoned (`TreeNode.poisoned`: no match reaches them or
    anything below them, so no acquire hands their bytes out; they hold a host copy, so no backup or
    storage write reads their device pages) until their device value is replaced or dropped, or
    `clear_poison` says a copy of their host values landed in their pages.

    Returns:
        The device indices to free (and any component frees), and the failed nodes kept on the
        device, root first (poisoned now).
    """
    end = start + int(device_indices.numel())
    first = next((c for c in _load_path(tree, key, start, end) if _holds_load(c, device_indices)), None)
    if first is None:
        return FreeResult(component_frees=tree._take_frees()), ()
    order: list[TreeNode] = []
    stack = [first]
    while stack:  # the device subtree of `first`, parents before children
        cur = stack.pop()
        order.append(cur)
        stack.extend(c for c in cur.children.values() if c.device_value is not None)
    freed: list[torch.Tensor] = []
    kept: list[NodeRef] = []
    for cur in reversed(order):  # children before parents
        dv = cur.device_value
        assert dv is not None
        if cur._dev_children or cur.backup_pending is not None:
            if bool(torch.isin(dv[:1], device_indices)):
                kept.append(tree._ref(cur))
            continue
        if cur.host_value is not None:
            freed.append(dv)
            tree._set_device(cur, None)
        elif not cur.children and not cur.device_lock and not cur.host_lock:
            freed.append(dv)
            tree._detach(cur)
        else:
            # A device-only node a holder keeps (locked, or with a host-only child): it stays, and its
            # parents with it. It holds none of the load's pages: those went to nodes that came from
            # the host, which keep their host copy until they leave the tree (only `_detach` drops it).
            assert not bool(torch.isin(dv[:1], device_indices)), "a loaded page on a device-only node"
    for ref in kept:
        _poison(tree, tree._nodes[ref.id])
    kept.reverse()
    return FreeResult(freed_device=cat_indices(freed), component_frees=tree._take_frees()), tuple(kept)


def poison_load(tree: RadixTree, key: KeyLike, start: int, device_indices: torch.Tensor) -> int:
    """Hide the nodes holding pages of a load-back whose copy may still write into them.

    Every node on the path of `key` from token `start` whose device pages are among `device_indices`
    is poisoned (no match reaches it or anything below it). Nothing else changes: the pages stay
    (the caller keeps them locked so nothing evicts and reuses them) until the copy settled and
    `drop_failed_load` takes them out.

    Args:
        key: the load's key.
        start: the load's first token.
        device_indices: the device pages the copy writes into.

    Returns:
        How many nodes were poisoned (none once the pages left the tree).

    Raises:
        TypeError, ValueError: a malformed key or a negative `start`.
    """
    poisoned = 0
    for child in _load_path(tree, key, start):
        if _holds_load(child, device_indices):
            if not child.poisoned:
                poisoned += 1
            _poison(tree, child)
    return poisoned


def _load_path(tree: RadixTree, key: KeyLike, start: int, end: int | None = None) -> list[TreeNode]:
    """The nodes whole in `key`'s path, root-first, that begin at token `start` or later (and before
    token `end`): those a load-back of tokens [start, end) may have attached its pages to.

    Raises:
        TypeError, ValueError: a malformed key or a negative `start`.
    """
    kb, _ = tree._aligned_key(key)
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"start: expected an int >= 0, got {start!r}")
    stop = len(kb) if end is None else end * TOKEN_BYTES
    nodes: list[TreeNode] = []
    node, pos, step = tree._root, 0, tree._step
    while pos < stop:
        child = node.children.get(kb[pos : pos + step])
        if child is None or not kb.startswith(child.key, pos):
            break
        if pos >= start * TOKEN_BYTES:
            nodes.append(child)
        node, pos = child, pos + len(child.key)
    return nodes


def _poison(tree: RadixTree, node: TreeNode) -> None:
    """Hide `node` (a failed load's node kept on the device) and everything below it from matching."""
    # A loaded node came from the host and keeps its host copy while it is on the device: a poisoned
    # node is never backed up from its device pages.
    assert node.host_value is not None, "a failed load-back's node without its host copy"
    if not node.poisoned:
        node.poisoned = True
        tree._num_poisoned += 1


def poisoned(tree: RadixTree, node: NodeRef) -> bool:
    """Whether `node`'s device pages hold a failed load-back's bytes (no match reaches it; see
    `drop_failed_load`).

    Raises:
        TypeError, ValueError: `node` is not a handle on a live node of this tree.
    """
    return tree._require_live(node).poisoned


def clear_poison(tree: RadixTree, key: KeyLike, start: int, device_indices: torch.Tensor) -> int:
    """A copy of the host values of poisoned nodes into their device pages `device_indices` landed:
    the poisoned nodes on the path of `key` from token `start` whose device pages are among them
    become hits again. Nodes whose device value changed meanwhile (dropped, evicted, replaced) are
    no longer poisoned anyway.

    Args:
        key: the failed load's key.
        start: the failed load's first token.
        device_indices: the device pages the copy wrote (the poisoned nodes' device values).

    Returns:
        How many nodes were cleared.
    """
    cleared = 0
    for child in _load_path(tree, key, start):
        if child.poisoned:
            dv = child.device_value
            assert dv is not None
            if bool(torch.isin(dv, device_indices).all()):
                child.poisoned = False
                tree._num_poisoned -= 1
                cleared += 1
    return cleared


def _holds_load(node: TreeNode, device_indices: torch.Tensor) -> bool:
    """Whether `node`'s device pages are among a load-back's `device_indices` (its first page says)."""
    dv = node.device_value
    return dv is not None and bool(torch.isin(dv[:1], device_indices))
