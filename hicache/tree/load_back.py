"""Load-back: attaching pages copied from the host back to the device to the nodes that cover them now."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from hicache.keys import TOKEN_BYTES, KeyLike
from hicache.tree import backups, matching
from hicache.tree.checks import cat_indices
from hicache.tree.handles import NodeRef
from hicache.tree.results import ComponentFree, LoadResult

if TYPE_CHECKING:
    from hicache.tree.radix import RadixTree

__all__ = ["LoadedComponents", "attach_loaded"]

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
