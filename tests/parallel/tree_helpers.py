"""Small trees for the fingerprint tests: the same operations, optionally with one difference."""

from __future__ import annotations

import torch

from hicache.tree import RadixTree


def indices(start: int, n: int) -> torch.Tensor:
    return torch.arange(start, start + n, dtype=torch.int64)


def build_tree(difference: str | bool = False, *, reverse: bool = False) -> RadixTree:
    """Three prompts sharing a prefix, inserted in order (or reversed); `difference` changes one thing:
    "lock" locks a node, "host" backs one node up, "extra" inserts one more page."""
    tree = RadixTree(page_size=2)
    prompts = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7, 8], [9, 10, 11, 12]]
    if reverse:
        prompts.reverse()
    base = 0
    for p in prompts:
        tree.insert(p, indices(base, len(p)))
        base += len(p)
    if difference == "lock":
        tree.lock_device(tree.match_prefix([1, 2, 3, 4, 7, 8]).last_device_node)
    elif difference == "extra":
        tree.insert([9, 10, 11, 12, 13, 14], indices(100, 6))
    elif difference == "host":
        node = tree.match_prefix([9, 10, 11, 12]).last_device_node
        tree.begin_backup(node, indices(200, tree.node_info(node).num_tokens))
        tree.commit_backup(node)
    return tree
