"""Inserting: a computed key's device pages (`insert`) and a storage refill's host pages (`insert_host`)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from hicache.keys import KeyLike
from hicache.policy import WritePolicy
from hicache.tree import backups
from hicache.tree.checks import check_indices
from hicache.tree.handles import NodeRef
from hicache.tree.matching import key_bytes
from hicache.tree.node import TreeNode, add_leaf, all_hashes, copy_indices, walk
from hicache.tree.results import InsertResult, make_insert

if TYPE_CHECKING:
    from hicache.tree.radix import RadixTree

__all__ = ["insert", "insert_host", "refill_backup_plan"]

logger = logging.getLogger("hicache.tree")

_WB = WritePolicy.WRITE_BACK
_INT64 = torch.int64


def _component_values(
    tree: RadixTree, components: Mapping[str, torch.Tensor], aligned: int
) -> dict[str, torch.Tensor] | None:
    """Validated copies of the caller's component values for a key of `aligned` tokens."""
    if tree._book is None:
        raise ValueError("components: this tree has no components")
    return tree._book.inputs(components, "components", aligned)


def insert(
    tree: RadixTree,
    key: KeyLike,
    device_indices: torch.Tensor,
    components: Mapping[str, torch.Tensor] | None = None,
) -> InsertResult:
    """Insert a key whose KV pages sit at `device_indices` on the device.

    Only the page-aligned part is inserted. Nodes that already hold device data are duplicates (the
    caller frees `device_indices[:prefix_len]`); host-only nodes on the path get the caller's device
    values re-attached; the rest becomes a new leaf. Every existing node on the path counts a hit, a
    new node starts at one hit (zero under write-back); nodes reaching the policy's threshold are
    returned in `backups`.

    Args:
        key: the token key.
        device_indices: a 1-D int64 tensor with one device index per token of the (unaligned) key.
        components: device indices of hybrid components by name: a sliding window's for a
            page-aligned suffix of the aligned key, a Mamba state's one slot (taken at the end of the
            key: kept only when the key is page-aligned). The tree takes ownership of all of them:
            nodes lacking a value on the device get their part, the rest comes back in the
            result's `component_frees`.

    Raises:
        TypeError: a key, `device_indices` or component indices of the wrong type or dtype.
        ValueError: `device_indices` of the wrong shape or length, or malformed component values.
    """
    kb = key_bytes(key)
    ntok = len(kb) >> 3
    step = tree._step
    end = len(kb)
    rem = end % step
    if rem:
        end -= rem
        kb = kb[:end]
    if not (
        type(device_indices) is torch.Tensor
        and device_indices.dtype is _INT64
        and device_indices.dim() == 1
        and device_indices.numel() == ntok
    ):
        check_indices(device_indices, "device_indices", ntok)
    comp_values = _component_values(tree, components, end >> 3) if components else None
    tree._clock = tick = tree._clock + 1
    backup_hits = tree._backup_hits
    root = tree._root
    # The duplicates first: the device stretch of the path, walked in C (each node counts a hit; those
    # reaching the policy's threshold go to `backups`); a device node matched in part is split and the
    # walk goes on.
    backups: list[NodeRef] = []
    pos, node, _, stop, matched = walk(root, kb, 0, step, tick, root, None, backups, backup_hits or 0)
    while stop is not None and stop.device_value is not None:
        tree._split(stop, matched)
        pos, node, _, stop, matched = walk(node, kb, pos, step, tick, root, None, backups, backup_hits or 0)
    prefix_bytes = pos
    values: torch.Tensor | None = None
    base = 0
    if stop is not None:
        # Host-only nodes follow (device prefix continuity): they get the caller's indices, from the first
        # non-duplicate token, copied once (the tree owns its values). Without a `stop` the walk ended at
        # the key's end or at a missing child: nothing to re-attach.
        values, base, pos, node = _reattach_host_nodes(tree, kb, pos, node, device_indices, tick, backups)
    if pos < end:
        # A new device leaf below `node`, made and counted in C (what `_new_node` and `_set_device` do: the
        # leaf holds no lock, no backup and no component yet).
        start = pos >> 3
        if values is None:
            value = copy_indices(device_indices, start, (end >> 3) - start)
        else:
            value = values[start - base :]
        node = add_leaf(tree, node, kb, pos, value, tick, backups, backup_hits)
    if tree._book is None:
        return make_insert(prefix_bytes >> 3, end >> 3, node._ref, tuple(backups), False, (), ())
    if comp_values:
        tree._book.attach(_key_path(tree, kb, root), 0, end >> 3, ntok, comp_values, "device")
    return make_insert(prefix_bytes >> 3, end >> 3, node._ref, tuple(backups), False, tree._take_frees(), ())


def _reattach_host_nodes(
    tree: RadixTree,
    kb: bytes,
    pos: int,
    node: TreeNode,
    device_indices: torch.Tensor,
    tick: int,
    backups: list[NodeRef],
) -> tuple[torch.Tensor, int, int, TreeNode]:
    """`insert`'s walk through the host-only nodes after the device stretch (which ends at byte `pos`, at
    `node`): each gets the caller's device values re-attached, counts a hit and, at the policy's
    threshold, joins `backups`. Returns the tree's copy of the caller's indices from token `base` on,
    `base`, and where the walk ended (byte, node)."""
    step = tree._step
    end = len(kb)
    backup_hits = tree._backup_hits
    base = pos >> 3
    values = copy_indices(device_indices, base, (end >> 3) - base)
    while pos < end:
        child = node.children.get(kb[pos : pos + step])
        if child is None:
            break
        ck = child.key
        if kb.startswith(ck, pos):
            matched = len(ck)
        else:
            matched = tree._matched_bytes(kb, pos, ck)
            child = tree._split(child, matched)
        child.last_access = tick
        child.hit_count += 1
        tree._set_device(child, values[(pos >> 3) - base : (pos + matched >> 3) - base])
        if (
            backup_hits is not None
            and child.hit_count >= backup_hits
            and child.host_value is None
            and child.backup_pending is None
        ):
            backups.append(child._ref)
        pos += matched
        node = child
    return values, base, pos, node


def _key_path(tree: RadixTree, kb: bytes, start: TreeNode) -> list[TreeNode]:
    """The nodes below `start` that exactly cover `kb` (after an insert, every boundary is a node's)."""
    path: list[TreeNode] = []
    step = tree._step
    node = start
    pos = 0
    while pos < len(kb):
        child = node.children[kb[pos : pos + step]]
        path.append(child)
        pos += len(child.key)
        node = child
    return path


def _refill_attach_point(tree: RadixTree, anchor: TreeNode, kb: bytes) -> tuple[int, TreeNode]:
    """Walk `kb` below `anchor` without changing anything: (bytes matched, the node the rest would hang
    from, or the node it would split)."""
    step = tree._step
    end = len(kb)
    node = anchor
    pos = 0
    while pos < end:
        child = node.children.get(kb[pos : pos + step])
        if child is None:
            return pos, node
        matched = tree._matched_bytes(kb, pos, child.key)
        pos += matched
        if matched < len(child.key):
            return pos, child
        node = child
    return pos, node


def refill_backup_plan(tree: RadixTree, anchor: NodeRef, key: KeyLike) -> tuple[NodeRef, ...]:
    """The plan for a storage refill that `insert_host` would drop: the un-backed chain (root first)
    to back up before it can attach; empty when it attaches as it is (or under write-back).

    Pure: nothing changes. The caller backs the chain up (`backup_chain` of its last node) and then
    calls `insert_host`, which drops it all the same if the backup did not happen.

    Args:
        anchor: a live node of this tree (the refill's anchor).
        key: the refill's tokens, continuing from the anchor's end.
    """
    start = tree._require_live(anchor, "anchor")
    kb, _ = tree._aligned_key(key)
    pos, attach = _refill_attach_point(tree, start, kb)
    if pos >= len(kb) or tree.write_policy is _WB or attach is tree._root or attach.host_value is not None:
        return ()
    return tuple(backups.backup_chain(tree, tree._ref(attach)))


def insert_host(
    tree: RadixTree,
    anchor: NodeRef,
    key: KeyLike,
    host_indices: torch.Tensor,
    hashes: list[bytes] | None = None,
    components: Mapping[str, torch.Tensor] | None = None,
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
        components: host indices of hybrid components by name, as for `insert` (relative to `key`).
            Unless the refill is dropped, the tree takes ownership of them (what no node takes comes
            back in the result's `component_frees`); a dropped refill leaves them to the caller.

    Raises:
        TypeError, ValueError: for a dead anchor or malformed key, indices or hashes.
    """
    start = tree._require_live(anchor, "anchor")
    kb, ntok = tree._aligned_key(key)
    check_indices(host_indices, "host_indices", ntok)
    if host_indices.device.type != "cpu":
        # Checked before any change: the copy the tree keeps is made through numpy, which takes CPU only.
        raise ValueError(f"host_indices: expected a CPU tensor, got one on {host_indices.device}")
    comp_values = _component_values(tree, components, len(kb) >> 3) if components else None
    step = tree._step
    end = len(kb)
    if hashes is not None:
        # Checked in C, in one pass (sets of the items' types and lengths took ~70 us per 2,048 pages).
        if not isinstance(hashes, list) or not all_hashes(hashes):
            raise TypeError("hashes: expected a list of 16-byte hashes")
        if len(hashes) != end // step:
            raise ValueError(f"hashes: expected {end // step} page hashes, got {len(hashes)}")
    # A dry walk first: a dropped refill must leave the tree untouched (no split either).
    pos, attach = _refill_attach_point(tree, start, kb)
    attach_backed = attach is tree._root or attach.host_value is not None
    if pos < end and not attach_backed and tree.write_policy is not _WB:
        logger.info(
            "insert_host dropped %d refill tokens: attach point node %d is not backed up",
            (end - pos) >> 3,
            attach.id,
        )
        plan = tuple(backups.backup_chain(tree, tree._ref(attach)))
        return make_insert(0, 0, tree._ref(start), (), True, (), plan)
    tree._clock += 1
    tick = tree._clock
    node = start
    pos = 0
    while pos < end:
        child = node.children.get(kb[pos : pos + step])
        if child is None:
            break
        matched = tree._matched_bytes(kb, pos, child.key)
        if matched < len(child.key):
            child = tree._split(child, matched)
        child.last_access = tick
        pos += matched
        node = child
    prefix = pos >> 3
    if pos < end:
        leaf = tree._new_node(node, kb[pos:])
        leaf.last_access = tick
        if hashes is not None:
            leaf._hashes = hashes[pos // step :]
        # The tree keeps its own copy, made in C (`copy_indices`: one memcpy, no torch op; `Tensor.clone` of
        # 32k+ indices runs as an OpenMP region that, with reader threads busy on every core, waited ~10 ms
        # for its second thread).
        tree._set_host(leaf, copy_indices(host_indices, prefix, (end >> 3) - prefix))
        tree._refresh(node)
        node = leaf
    if comp_values:
        assert tree._book is not None
        tree._book.attach(_key_path(tree, kb, start), 0, end >> 3, ntok, comp_values, "host")
    return make_insert(prefix, end >> 3, tree._ref(node), (), False, tree._take_frees(), ())
