"""The tree answers every question the controller asks (peek, depth, hashes, stored path, node snapshots,
held indices) and owns every tree operation (attaching loaded pages), returning what the caller must
free; callers hold handles the tree validates. One scenario per test."""

from __future__ import annotations

import pytest
import torch

from hicache.components import MambaState, SlidingWindow
from hicache.keys import ROOT_HASH, as_key_bytes, chained_page_hashes
from hicache.layout import KVLayout
from hicache.tree import NodeRef, RadixTree

P = 4


def page_key(start: int, pages: int) -> list[int]:
    return list(range(start, start + pages * P))


def ids(start: int, n: int) -> torch.Tensor:
    return torch.arange(start, start + n, dtype=torch.int64)


def back_up(tree: RadixTree, node: object, first_host: int = 1000) -> None:
    """Run the whole backup chain of `node` to completion, root-first."""
    chain = tree.backup_chain(node)  # type: ignore[arg-type]
    for i, n in enumerate(chain):
        tree.begin_backup(n, ids(first_host + 100 * i, tree.node_info(n).num_tokens))  # type: ignore[arg-type]
    for n in chain:
        tree.commit_backup(n)


def snapshot(tree: RadixTree) -> tuple[object, ...]:
    """Everything a read-only query must leave as it was."""
    nodes = sorted((tree.node_info(n).ref.id, tree.node_info(n).last_access) for n in tree.iter_nodes())  # type: ignore[arg-type]
    return (tree.statistics(), tree._clock, tuple(nodes))


def test_peek_foretells_a_match_ending_inside_a_node_without_splitting_it() -> None:
    """`peek` must not split (a split node would stay split) nor advance the LRU clock (a peek would
    then protect the prefix from eviction as if it had been used)."""
    tree = RadixTree(P)
    tree.insert(page_key(0, 4), ids(0, 16))
    before = snapshot(tree)
    peeked = tree.peek(page_key(0, 2) + page_key(500, 1))
    assert (peeked.device_len, peeked.host_len, peeked.anchor_len) == (8, 0, 0)
    assert snapshot(tree) == before
    assert tree.statistics().num_nodes == 1
    m = tree.match_prefix(page_key(0, 2) + page_key(500, 1))
    assert (m.device_len, m.host_len) == (peeked.device_len, peeked.host_len)
    assert tree.statistics().num_nodes == 2  # the match did split


def test_peek_reports_the_host_part_and_the_anchor_a_prefetch_continues_from() -> None:
    """Beyond the device part, host-only nodes count as host hits; the anchor is the end of the deepest
    backed-up node matched (inside a node when the key ends there)."""
    tree = RadixTree(P)
    leaf = tree.insert(page_key(0, 4), ids(0, 16)).node
    back_up(tree, leaf)
    tree.demote(leaf)
    peeked = tree.peek(page_key(0, 3) + page_key(900, 2))
    assert (peeked.device_len, peeked.host_len, peeked.anchor_len, peeked.matched_len) == (0, 12, 12, 12)


def test_peek_with_a_sliding_window_ends_where_a_split_match_would() -> None:
    """With components, a partly matched node's window value is what its upper part would get from a
    split: `peek` must agree with the match that does split."""
    layout = KVLayout.flat(8, P)
    tree = RadixTree(P, components=[SlidingWindow(8, layout, 16, 16), MambaState(32, 8, 8)])
    a, b = page_key(0, 4), page_key(100, 4)
    tree.insert(a, ids(0, 16), {"swa": ids(0, 8), "mamba": ids(0, 1)})
    tree.insert(a + b, ids(0, 32), {"swa": ids(8, 16), "mamba": ids(1, 1)})
    for key in (a + b, a + b[:8], a[:8], a + b[:4]):
        peeked = tree.peek(key)
        m = tree.match_prefix(key)
        assert (peeked.device_len, peeked.host_len) == (m.device_len, m.host_len), key
    tree.sanity_check()


def test_depth_hashes_and_last_hash_are_answered_by_the_tree() -> None:
    """The controller needs where a node ends and its page hashes without walking parents itself."""
    tree = RadixTree(P)
    tree.insert(page_key(0, 2), ids(0, 8))
    leaf = tree.insert(page_key(0, 2) + page_key(50, 3), ids(0, 20)).node
    assert tree.depth(leaf) == 20
    expected = chained_page_hashes(
        as_key_bytes(page_key(0, 2) + page_key(50, 3)), P, tree.namespace, ROOT_HASH
    )
    assert tree.page_hashes(leaf) == expected[2:]
    assert tree.last_hash(leaf) == expected[-1]
    root = tree.node_info(leaf).parent
    assert root is not None
    assert tree.depth(tree.node_info(root).parent) == 0  # type: ignore[arg-type]
    assert tree.last_hash(tree.node_info(root).parent) == ROOT_HASH  # type: ignore[arg-type]


def test_node_info_is_a_snapshot_with_handles_not_nodes() -> None:
    """A snapshot names parent and children by handle; changing the tree later does not change it."""
    tree = RadixTree(P)
    leaf = tree.insert(page_key(0, 3), ids(0, 12)).node
    info = tree.node_info(leaf)
    assert isinstance(info.ref, NodeRef)
    assert (info.num_tokens, info.device_lock, info.backed_up) == (12, 0, False)
    assert info.device_value is not None
    assert torch.equal(info.device_value, ids(0, 12))
    tree.lock_device(leaf)
    assert info.device_lock == 0
    assert tree.node_info(info.ref).device_lock == 1
    parent = info.parent
    assert parent is not None
    assert tree.node_info(parent).children == (info.ref,)


def test_a_handle_of_a_removed_node_or_of_another_tree_is_rejected() -> None:
    """A stale handle must not reach whatever node later lives at its place: ids are never reused, and
    a handle carries its tree."""
    tree = RadixTree(P)
    ref = tree.node_info(tree.insert(page_key(0, 2), ids(0, 8)).node).ref
    other = RadixTree(P)
    other.insert(page_key(0, 2), ids(0, 8))
    with pytest.raises(ValueError, match="not a live node of this tree"):
        other.lock_device(NodeRef(ref.tree, ref.id))  # type: ignore[arg-type]
    tree.evict_device(8)
    assert not tree.is_live(ref)
    tree.insert(page_key(0, 2), ids(0, 8))
    with pytest.raises(ValueError, match="not a live node of this tree"):
        tree.lock_device(ref)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="expected a NodeRef"):
        tree.lock_device((ref.tree, ref.id))  # type: ignore[arg-type]


def test_stored_path_stops_at_the_first_node_without_a_host_copy() -> None:
    """Under write-back a backed-up node may hang below an un-backed one; storage finds pages by prefix,
    so the stored path holds only the leading backed-up nodes."""
    tree = RadixTree(P, write_policy="write_back")
    upper = tree.insert(page_key(0, 2), ids(0, 8)).node
    leaf = tree.insert(page_key(0, 2) + page_key(50, 2), ids(0, 16)).node
    assert tree.stored_path(leaf) is None  # not backed up
    back_up(tree, leaf)
    path = tree.stored_path(leaf)
    assert path is not None
    assert path.nodes == (tree.node_info(upper).ref, tree.node_info(leaf).ref)
    assert path.hashes == tree.page_hashes(upper) + tree.page_hashes(leaf)
    assert [int(v.numel()) for v in path.host_values] == [8, 8]
    tree.evict_device(16)
    tree.evict_host(16)
    assert tree.stored_path(leaf) is None  # removed from the tree


def test_attach_loaded_frees_duplicates_and_returns_the_fresh_match() -> None:
    """While a load-back copy ran, another request loaded the first node again: its copied pages are
    duplicates the caller frees; the rest is attached and the fresh match covers the whole key."""
    tree = RadixTree(P)
    upper = tree.insert(page_key(0, 2), ids(0, 8)).node
    leaf = tree.insert(page_key(0, 2) + page_key(50, 2), ids(0, 16)).node
    back_up(tree, leaf)
    tree.evict_device(16)
    key = page_key(0, 2) + page_key(50, 2)
    m = tree.match_prefix(key)
    assert (m.device_len, m.host_len) == (0, 16)
    assert torch.equal(m.host_indices, torch.cat([ids(1000, 8), ids(1100, 8)]))
    tree.attach_device(upper, ids(300, 8))  # the other request's load
    result = tree.attach_loaded(key, 0, ids(200, 16))
    assert torch.equal(result.freed_device, ids(200, 8))
    assert (result.match.device_len, result.match.host_len) == (16, 0)
    assert torch.equal(result.match.device_indices, torch.cat([ids(300, 8), ids(208, 8)]))
    assert result.component_frees == ()
    tree.sanity_check()


def test_attach_loaded_walks_the_key_once() -> None:
    """Guards against `attach_loaded` matching twice (the span, then the whole key for the fresh match):
    one walk finds the span and gives the fresh match, so it touches the LRU clock once, as a match does.
    The span still splits at its end: a key longer than the loaded span gets a node ending there."""
    tree = RadixTree(P)
    key = page_key(0, 2) + page_key(50, 2)
    leaf = tree.insert(key, ids(0, 16)).node
    back_up(tree, leaf)
    tree.evict_device(16)
    first = tree.match_prefix(key)
    (host_node,) = first.host_nodes
    ticked = tree.node_info(host_node).last_access
    result = tree.attach_loaded(key, 0, ids(200, 8))  # the first page pair only: a split at token 8
    (upper, lower) = (result.match.last_device_node, *result.match.host_nodes)
    assert tree.node_info(upper).last_access == ticked + 1
    assert tree.node_info(lower).last_access == ticked + 1
    assert (result.match.device_len, result.match.host_len) == (8, 8)
    assert torch.equal(result.match.device_indices, ids(200, 8))
    assert result.freed_device.numel() == 0
    again = tree.match_prefix(key)
    assert tree.node_info(upper).last_access == ticked + 2
    assert (again.device_len, again.host_len) == (8, 8)
    tree.sanity_check()


def test_attach_loaded_returns_a_component_copy_whose_host_value_changed() -> None:
    """A component copy is taken only if its node still holds the host value it was copied from;
    otherwise the copy comes back in `component_frees` (never leaked, never attached stale)."""
    tree = RadixTree(P, components=[MambaState(32, 8, 8)])
    key = page_key(0, 2)
    leaf = tree.insert(key, ids(0, 8), {"mamba": ids(0, 1)}).node
    tree.begin_backup(leaf, ids(1000, 8), {"mamba": ids(5, 1)})
    tree.commit_backup(leaf)
    tree.evict_device(8)
    m = tree.match_prefix(key)
    (host_node,) = m.host_nodes
    stale = ids(99, 1)  # not the node's host value
    result = tree.attach_loaded(key, 0, ids(200, 8), {(host_node, "mamba"): (stale, ids(7, 1))})
    assert result.match.device_len == 0  # loaded, but no Mamba state on the device: not a valid end
    assert [(f.component, f.tier, f.indices.tolist()) for f in result.component_frees] == [
        ("mamba", "device", [7])
    ]
    assert tree.node_info(host_node).device_value is not None
    tree.sanity_check()


def test_eviction_results_carry_the_component_indices_they_let_go_of() -> None:
    """Component frees come back in the result of the operation that let them go: nothing to drain."""
    tree = RadixTree(P, components=[MambaState(32, 8, 8)])
    r = tree.insert(page_key(0, 2), ids(0, 8), {"mamba": ids(3, 1)})
    assert r.component_frees == ()
    dup = tree.insert(page_key(0, 2), ids(0, 8), {"mamba": ids(4, 1)})
    assert [f.indices.tolist() for f in dup.component_frees] == [[4]]  # the node already has a state
    evicted = tree.evict_device(8)
    assert [(f.component, f.tier, f.indices.tolist()) for f in evicted.component_frees] == [
        ("mamba", "device", [3])
    ]


def test_held_indices_list_every_index_the_tree_owns() -> None:
    """The controller's ownership check reads held indices from the tree, not from node fields."""
    tree = RadixTree(P, components=[MambaState(32, 8, 8)])
    leaf = tree.insert(page_key(0, 2), ids(0, 8), {"mamba": ids(3, 1)}).node
    tree.begin_backup(leaf, ids(1000, 8), {"mamba": ids(6, 1)})
    held = tree.held_indices()
    assert [t.tolist() for t in held.device] == [ids(0, 8).tolist()]
    assert held.host == ()
    assert [t.tolist() for t in held.backup_pending] == [ids(1000, 8).tolist()]
    assert {k: [t.tolist() for t in v] for k, v in held.components.items()} == {
        ("mamba", "device"): [[3]],
        ("mamba", "pending"): [[6]],
    }


def test_branches_sum_each_top_level_subtree() -> None:
    """`branches()` answers what the demo's top-prefixes table read node by node through snapshots: per
    child of the root, its key and hits and the nodes and tokens below it on each tier."""
    tree = RadixTree(P)
    assert tree.branches() == []
    system_a, system_b = page_key(0, 2), page_key(500, 1)
    leaf = tree.insert(system_a + page_key(200, 2), ids(20, 16)).node
    back_up(tree, leaf)
    tree.insert(system_a + page_key(100, 1), ids(0, 12))  # splits the backed-up node after system_a
    tree.insert(system_b, ids(40, 4))
    assert tree.evict_device(8).evicted_tokens == 8  # the oldest leaf, backed up: it stays on the host
    assert tree.node_info(leaf).device_value is None
    by_key = {b.key: b for b in tree.branches()}
    assert set(by_key) == {as_key_bytes(system_a), as_key_bytes(system_b)}
    a, b = by_key[as_key_bytes(system_a)], by_key[as_key_bytes(system_b)]
    assert (a.nodes, a.hits, a.device_tokens, a.host_tokens) == (3, 2, 12, 16)
    assert (b.nodes, b.hits, b.device_tokens, b.host_tokens) == (1, 1, 4, 0)
    assert tree.node_info(a.node).parent == tree.root
