"""Matching: the longest cached prefix of a key (`match_prefix`, which splits and touches the LRU clock;
`peek`, which changes nothing) and the read-only queries on a node the controller needs."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from hicache.keys import KeyLike, as_key_bytes
from hicache.tree.handles import NodeRef, StoredPath
from hicache.tree.node import TreeNode, walk
from hicache.tree.results import EMPTY_INDICES, MatchResult, PrefixPeek, make_match

if TYPE_CHECKING:
    from hicache.tree.radix import RadixTree

__all__ = [
    "depth",
    "device_indices",
    "key_bytes",
    "last_hash",
    "match_bounds",
    "match_of_walk",
    "match_prefix",
    "node_at",
    "page_hashes",
    "peek",
    "stored_path",
    "walk_key",
]

_LITTLE = sys.byteorder == "little"


def key_bytes(key: KeyLike) -> bytes:
    """`key` as int64 bytes, with a fast path for the common key types (else `as_key_bytes`)."""
    kt = type(key)
    if kt is array and key.typecode == "q" and _LITTLE:  # type: ignore[union-attr]
        return key.tobytes()  # type: ignore[union-attr]
    if kt is bytes and not len(key) & 7:
        return key  # type: ignore[return-value]
    return as_key_bytes(key)


def match_prefix(tree: RadixTree, key: KeyLike) -> MatchResult:
    """Find the longest cached page-aligned prefix of `key` on the device and, beyond it, on the host.

    A match ending inside a node splits it; every node the key runs through has its `last_access`
    advanced. With components the match is truncated to the deepest node where every
    component allows a prefix to end (a complete sliding window, a Mamba state): at the deepest
    host-only node that is valid once loaded (device nodes before it need not be valid ends), else at
    the deepest valid device node.

    Args:
        key: the token key (bytes, `array('q')`, a 1-D integer tensor or a sequence of ints).

    Raises:
        TypeError, ValueError: for a key that cannot be converted (see `hicache.keys.as_key_bytes`).
    """
    kb = key_bytes(key)
    step = tree._step
    end = len(kb)
    rem = end % step
    if rem:
        end -= rem
        kb = kb[:end]
    if tree._book is not None:
        return _match_hybrid(tree, kb)
    tree._clock = tick = tree._clock + 1
    root = tree._root
    device_values: list[torch.Tensor] = []
    # The device stretch of the path (the common case) in C; a node matched in part is split and the
    # walk goes on; host-only nodes, which by device prefix continuity only follow it, in
    # `_match_host_tail`.
    pos, node, last_host, stop, matched = walk(root, kb, 0, step, tick, root, device_values, None, 0)
    while stop is not None:
        if matched < len(stop.key):
            stop = tree._split(stop, matched)
        if stop.device_value is None:
            return _match_host_tail(tree, kb, pos, node, last_host, device_values, tick)
        pos, node, last_host, stop, matched = walk(
            node, kb, pos, step, tick, last_host, device_values, None, 0
        )
    return make_match(
        kb,
        tuple(device_values),
        pos >> 3,
        0,
        node._ref,
        last_host._ref,
        (),
        node._path_indices,
        (),
    )


def _match_host_tail(
    tree: RadixTree,
    kb: bytes,
    pos: int,
    last_device: TreeNode,
    last_host: TreeNode,
    device_values: list[torch.Tensor],
    tick: int,
) -> MatchResult:
    """The rest of `match_prefix` from the end of the device stretch (`last_device`, at byte `pos`) on:
    the host-only nodes below it."""
    step = tree._step
    end = len(kb)
    device_end = pos
    host_nodes: list[TreeNode] = []
    node = last_device
    while pos < end:
        child = node.children.get(kb[pos : pos + step])
        if child is None:
            break
        ck = child.key
        if kb.startswith(ck, pos):
            pos += len(ck)
        else:
            matched = tree._matched_bytes(kb, pos, ck)
            child = tree._split(child, matched)
            pos += matched
        child.last_access = tick
        host_nodes.append(child)
        if child.host_value is not None:
            last_host = child
        node = child
    return make_match(
        kb,
        tuple(device_values),
        device_end >> 3,
        (pos - device_end) >> 3,
        tree._ref(last_device),
        tree._ref(last_host),
        tuple([tree._ref(n) for n in host_nodes]),
        last_device._path_indices,
        tuple(n.host_value for n in host_nodes if n.host_value is not None),
    )


def _match_hybrid(tree: RadixTree, kb: bytes) -> MatchResult:
    """`match_prefix` with components: the walk of the base, then truncated to where every component
    allows a prefix to end (beyond the device part once its host-only nodes are loaded, else at the
    deepest valid device node)."""
    return match_of_walk(tree, kb, walk_key(tree, kb, len(kb)))


def walk_key(tree: RadixTree, kb: bytes, cut: int) -> list[TreeNode]:
    """The nodes page-aligned `kb` runs through, root-first, each touched on the LRU clock (one tick).

    A node the key ends inside is split where it ends (as `match_prefix` does), and a node across byte
    `cut` is split there.
    """
    tree._clock += 1
    tick = tree._clock
    step = tree._step
    end = len(kb)
    node = tree._root
    pos = 0
    path: list[TreeNode] = []
    while pos < end:
        child = node.children.get(kb[pos : pos + step])
        if child is None:
            break
        ck = child.key
        matched = len(ck) if kb.startswith(ck, pos) else tree._matched_bytes(kb, pos, ck)
        if pos < cut < pos + matched:
            matched = cut - pos
        if matched < len(ck):
            child = tree._split(child, matched)
        child.last_access = tick
        path.append(child)
        pos += matched
        node = child
    return path


def match_bounds(tree: RadixTree, path: list[TreeNode]) -> tuple[int, int, int]:
    """Where a match along the walk `path` ends: `(i, k, j)` with its device nodes `path[:i]` and its
    host-only nodes `path[k:k + j]` (`k` ends the device stretch). Without components `i = k` and every
    node after the stretch is taken; with them, the match first tries to end beyond the device part
    (valid once its host-only nodes are loaded), else at the deepest valid device node."""
    k = 0
    while k < len(path) and path[k].device_value is not None:
        k += 1
    j = len(path) - k
    book = tree._book
    if book is None:
        return k, k, j
    root = tree._root
    while j > 0 and not book.valid_end(path[k + j - 1], root, None):
        j -= 1
    i = k
    if j == 0:
        while i > 0 and not book.valid_end(path[i - 1], root, "device"):
            i -= 1
    return i, k, j


def match_of_walk(tree: RadixTree, kb: bytes, path: list[TreeNode]) -> MatchResult:
    """The match of `kb` whose walk is `path` (see `_bounds` for where it ends)."""
    i, k, j = match_bounds(tree, path)
    device_nodes = path[:i]
    host_nodes = path[k : k + j]
    last_device = device_nodes[-1] if device_nodes else tree._root
    last_host = tree._root
    for n in reversed(path[: i + j]):
        if n.host_value is not None:
            last_host = n
            break
    device_values = tuple(n.device_value for n in device_nodes if n.device_value is not None)
    return make_match(
        kb,
        device_values,
        sum(n.num_tokens for n in device_nodes),
        sum(n.num_tokens for n in host_nodes),
        tree._ref(last_device),
        tree._ref(last_host),
        tuple([tree._ref(n) for n in host_nodes]),
        last_device._path_indices,
        tuple(n.host_value for n in host_nodes if n.host_value is not None),
    )


# ------------------------------------------------------------------ queries that change nothing


def peek(tree: RadixTree, key: KeyLike) -> PrefixPeek:
    """What `match_prefix(key)` would find, without splitting a node or touching the LRU clock.

    Args:
        key: the token key (as for `match_prefix`).

    Raises:
        TypeError, ValueError: for a key that cannot be converted (see `hicache.keys.as_key_bytes`).
    """
    kb = key_bytes(key)
    step = tree._step
    end = len(kb) - len(kb) % step
    kb = kb[:end]
    # The walk: per node, the tokens of it the key matches (only the last may be partial).
    path: list[tuple[TreeNode, int]] = []
    node = tree._root
    pos = 0
    while pos < end:
        child = node.children.get(kb[pos : pos + step])
        if child is None:
            break
        matched = tree._matched_bytes(kb, pos, child.key)
        path.append((child, matched >> 3))
        pos += matched
        if matched < len(child.key):
            break
        node = child
    k = 0
    while k < len(path) and path[k][0].device_value is not None:
        k += 1
    i, j = k, len(path) - k
    if tree._book is not None:
        # As `_match_hybrid`: end beyond the device part if valid once loaded, else on the device.
        while j > 0 and not _peek_valid(tree, path, k + j - 1, None):
            j -= 1
        if j == 0:
            while i > 0 and not _peek_valid(tree, path, i - 1, "device"):
                i -= 1
    device_len = sum(t for _, t in path[:i])
    host_len = sum(t for _, t in path[k : k + j])
    anchor_len = 0
    pos = 0
    for n, t in path[: i + j]:
        pos += t
        if n.host_value is not None:
            anchor_len = pos
    return PrefixPeek(device_len, host_len, anchor_len)


def _peek_valid(tree: RadixTree, path: list[tuple[TreeNode, int]], idx: int, tier: str | None) -> bool:
    """Whether every component allows a prefix ending `path[idx][1]` tokens into `path[idx][0]`
    (the value of a partly matched node is what its upper part would get from a split)."""
    book = tree._book
    assert book is not None
    for comp in book.components:

        def values(name: str = comp.name) -> Iterator[tuple[int, torch.Tensor | None]]:
            for m in range(idx, -1, -1):
                cur, t = path[m]
                cur_tier = tier or ("device" if cur.device_value is not None else "host")
                value = book.value(cur, name, cur_tier)
                if value is not None and t < cur.num_tokens:
                    value = book.index[name].split(value, t, cur.num_tokens)[0]
                yield t, value

        if not comp.valid_end(values()):
            return False
    return True


def depth(tree: RadixTree, node: NodeRef) -> int:
    """Tokens from the root to the end of `node` (O(depth))."""
    cur = tree._require_live(node)
    depth = 0
    while cur is not tree._root:
        depth += len(cur.key) >> 3
        assert cur.parent is not None
        cur = cur.parent
    return depth


def page_hashes(tree: RadixTree, node: NodeRef) -> list[bytes]:
    """`node`'s own page hashes, one per page (a copy; empty for the root)."""
    return list(tree._require_live(node).hashes)


def last_hash(tree: RadixTree, node: NodeRef) -> bytes:
    """The hash of `node`'s last page: what the hashes of pages below it continue from."""
    return tree._require_live(node).last_hash


def device_indices(tree: RadixTree, node: NodeRef) -> torch.Tensor:
    """The device indices of the root path ending at `node`, joined (cached on the node; read-only).

    Raises:
        ValueError: `node` or one of its ancestors is not on the device.
    """
    live = tree._require_live(node)
    if live is tree._root:
        return EMPTY_INDICES
    if live.device_value is None:
        raise ValueError(f"node: node {live.id} is not on the device")
    return tree._path_device_indices(live)


def stored_path(tree: RadixTree, node: NodeRef) -> StoredPath | None:
    """The leading backed-up nodes of the root path to `node`, with their page hashes and host values
    (what a storage write of that path needs); `None` when `node` left the tree or is not backed up.
    """
    try:
        live = tree._require_non_root(node)
    except ValueError:
        return None
    if live.host_value is None:
        return None
    path: list[TreeNode] = []
    cur = live
    while cur is not tree._root:
        path.append(cur)
        assert cur.parent is not None
        cur = cur.parent
    path.reverse()
    nodes: list[NodeRef] = []
    hashes: list[tuple[bytes, ...]] = []
    values: list[torch.Tensor] = []
    for n in path:
        if n.host_value is None:
            break
        nodes.append(tree._ref(n))
        hashes.append(tuple(n.hashes))
        values.append(n.host_value)
    return StoredPath(tuple(nodes), tuple(hashes), tuple(values))


def node_at(tree: RadixTree, key: KeyLike, tokens: int) -> NodeRef:
    """The node of `key`'s cached path that ends exactly `tokens` tokens in, splitting the node that
    spans that point if needed; the LRU clock is not touched (what `peek`'s `anchor_len` names).

    Args:
        key: the token key.
        tokens: a page-aligned position on the cached path of `key` (0: the root).

    Raises:
        TypeError, ValueError: a malformed key, a position that is not page-aligned, or a path that
            ends before it.
    """
    kb, _ = tree._aligned_key(key)
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0 or tokens % tree.page_size:
        raise ValueError(f"tokens: expected a page-aligned int >= 0, got {tokens!r}")
    end = tokens * 8
    if end > len(kb):
        raise ValueError(f"tokens: {tokens} is beyond the page-aligned key")
    step = tree._step
    node = tree._root
    pos = 0
    while pos < end:
        child = node.children.get(kb[pos : pos + step])
        if child is None:
            raise ValueError(f"tokens: the cached path of the key ends at {pos >> 3}, before {tokens}")
        matched = tree._matched_bytes(kb[:end], pos, child.key)
        if matched < len(child.key):
            if pos + matched < end:
                raise ValueError(
                    f"tokens: the cached path of the key ends at {(pos + matched) >> 3}, before {tokens}"
                )
            child = tree._split(child, matched)
        pos += matched
        node = child
    return tree._ref(node)
