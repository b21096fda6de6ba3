"""The tree's C part (`native/hicache_tree.c`): the walk stops where Python must take over, and the records
it makes without `__init__` have every slot set."""

from __future__ import annotations

import pytest
import torch

import _hicache_tree
from hicache.keys import ROOT_HASH, chained_page_hashes
from hicache.tree import RadixTree
from hicache.tree.node import TreeNode, new_node
from hicache.tree.results import InsertResult, MatchResult, make_insert, make_match

PAGE = 2
STEP = PAGE * 8


def _key(*tokens: int) -> bytes:
    return torch.tensor(tokens, dtype=torch.int64).numpy().tobytes()


def _tree_with(*keys: bytes) -> RadixTree:
    tree = RadixTree(PAGE)
    for k in keys:
        tree.insert(k, torch.arange(len(k) // 8, dtype=torch.int64))
    return tree


def test_a_node_made_in_c_has_every_slot_set() -> None:
    """Guards against a slot added to `TreeNode` but not to `new_node`'s defaults: reading it would raise
    `AttributeError` far from where the node was made."""
    tree = RadixTree(PAGE)
    node = new_node(7, None, b"", (PAGE, tree.namespace), tree.root)
    for name in TreeNode.__slots__:
        getattr(node, name)
    assert node.children == {}
    assert node.children is not new_node(8, None, b"", node._ctx, tree.root).children


def test_the_results_made_in_c_have_every_slot_set() -> None:
    """The same for the records of `match_prefix` and `insert`."""
    ref = RadixTree(PAGE).root
    match = make_match(b"", (), 0, 0, ref, ref, (), None, ())
    insert = make_insert(0, 0, ref, (), False, (), ())
    for record, cls in ((match, MatchResult), (insert, InsertResult)):
        assert type(record) is cls
        for name in cls.__slots__:
            getattr(record, name)


def test_a_maker_refuses_names_that_are_not_slots_and_wrong_argument_counts() -> None:
    with pytest.raises(TypeError, match="nope"):
        _hicache_tree.maker(TreeNode, ("nope",), {})
    with pytest.raises(TypeError, match="hashes"):  # a property, not a slot
        _hicache_tree.maker(TreeNode, ("hashes",), {})
    make = _hicache_tree.maker(MatchResult, ("key",), {})
    with pytest.raises(TypeError, match="expected 1 positional"):
        make()


def test_the_walk_stops_before_a_node_the_key_matches_in_part() -> None:
    """The walk leaves splits to Python: it stops before the node, untouched, with the whole pages that
    match."""
    tree = _tree_with(_key(1, 2, 3, 4, 5, 6))
    root = tree._root
    (child,) = root.children.values()
    before = child.last_access
    values: list[torch.Tensor] = []
    pos, node, last_host, stop, matched = _hicache_tree.walk(
        root, _key(1, 2, 3, 4, 9, 9), 0, STEP, 99, root, values, None, 0
    )
    assert (pos, node, last_host, stop, matched) == (0, root, root, child, 2 * STEP)
    assert values == []
    assert child.last_access == before


def test_the_walk_passes_whole_device_nodes_and_stops_before_a_host_only_one() -> None:
    """Whole device nodes are touched and their values collected; a host-only node ends the walk (the
    host tail is Python's)."""
    tree = _tree_with(_key(1, 2, 3, 4), _key(1, 2, 3, 4, 5, 6))
    root = tree._root
    (top,) = root.children.values()
    (leaf,) = top.children.values()
    for start, node in ((0, top), (100, leaf)):  # write-through backs up root-first
        tree.begin_backup(tree._ref(node), torch.arange(start, start + node.num_tokens, dtype=torch.int64))
        tree.commit_backup(tree._ref(node))
    tree.demote(tree._ref(leaf))
    values: list[torch.Tensor] = []
    pos, node, last_host, stop, matched = _hicache_tree.walk(
        root, _key(1, 2, 3, 4, 5, 6), 0, STEP, tree._clock, root, values, None, 0
    )
    assert (pos, node, last_host, stop, matched) == (2 * STEP, top, top, leaf, STEP)
    assert len(values) == 1
    assert values[0] is top.device_value
    assert top.last_access == tree._clock
    tree.sanity_check()


def test_the_walk_counts_hits_and_hands_back_the_handles_that_reach_the_threshold() -> None:
    tree = _tree_with(_key(1, 2, 3, 4))
    root = tree._root
    (top,) = root.children.values()
    hits = top.hit_count
    backups: list[object] = []
    _hicache_tree.walk(root, _key(1, 2, 3, 4), 0, STEP, tree._clock, root, None, backups, hits + 1)
    assert top.hit_count == hits + 1
    assert backups == [tree._ref(top)]


@pytest.mark.parametrize(
    ("key", "pos", "error"),
    [("not bytes", 0, TypeError), (_key(1, 2, 3), 0, ValueError), (_key(1, 2), 8, ValueError)],
)
def test_the_walk_refuses_a_malformed_key_or_position(key: object, pos: int, error: type[Exception]) -> None:
    tree = RadixTree(PAGE)
    with pytest.raises(error):
        _hicache_tree.walk(tree._root, key, pos, STEP, 1, tree._root, None, None, 0)


def test_the_tree_keeps_its_own_copy_of_the_inserted_indices() -> None:
    """Guards against the C copy of `insert` (numpy memory filled from the caller's `data_ptr`) sharing
    the caller's memory or reading from the wrong offset: the leaf holds exactly the caller's indices
    after the duplicate prefix, and writing into the caller's tensor afterwards changes nothing."""
    tree = _tree_with(_key(1, 2, 3, 4))
    indices = torch.arange(100, 108, dtype=torch.int64)
    caller = indices[2:]  # a view at an offset into a larger storage
    result = tree.insert(_key(1, 2, 3, 4, 5, 6), caller)
    assert result.prefix_len == 4
    expected = caller.clone()
    caller.fill_(-1)
    assert torch.equal(tree.match_prefix(_key(1, 2, 3, 4, 5, 6)).device_indices[4:], expected[4:])
    tree.sanity_check()


def test_a_strided_insert_is_copied_by_torch_and_joins_match_torch_cat() -> None:
    """Guards against the C copy taking a strided tensor's `data_ptr` as if it were contiguous; and
    checks that the C join of a match's values is `torch.cat` of them."""
    tree = RadixTree(PAGE)
    strided = torch.arange(20, dtype=torch.int64)[::2]
    assert not strided.is_contiguous()
    tree.insert(_key(*range(1, 11)), strided)
    tree.insert(_key(*range(1, 5), 50, 51), torch.arange(200, 206, dtype=torch.int64))
    match = tree.match_prefix(_key(*range(1, 11)))
    assert len(match.device_values) == 2
    assert torch.equal(match.device_indices, strided)
    assert torch.equal(match.device_indices, torch.cat(match.device_values))
    tree.sanity_check()


def test_copy_out_and_join_refuse_what_they_cannot_copy() -> None:
    """Guards against the C copies reading a null address or a part that is not CPU memory they may read
    (their callers pass raw addresses; a part they cannot read must fall back to `torch.cat`)."""
    src = torch.arange(8, dtype=torch.int64)
    assert _hicache_tree.copy_out(src.data_ptr() + 16, 3).tolist() == [2, 3, 4]
    assert _hicache_tree.copy_out(0, 0).numel() == 0
    with pytest.raises(ValueError, match="null address"):
        _hicache_tree.copy_out(0, 4)
    with pytest.raises(ValueError, match="negative"):
        _hicache_tree.copy_out(src.data_ptr(), -1)
    assert _hicache_tree.join((src[:2], src[6:])).tolist() == [0, 1, 6, 7]
    assert _hicache_tree.join((src[:2], src[::2])) is None  # strided: the caller uses torch.cat
    assert _hicache_tree.join([src[:1]] * 65) is None  # more parts than the C join takes
    with pytest.raises(TypeError):
        _hicache_tree.join(3)


def test_a_leaf_made_in_c_is_counted_like_one_made_in_python() -> None:
    """Guards against `add_leaf` (an insert's new leaf, made and counted in C) missing a slot, a counter or
    the leaf set: every slot is set, and the counters, the node table and the evictable device leaves it
    keeps are what `sanity_check` recomputes, for a leaf below the root and below a device leaf (which
    stops being an evictable leaf)."""
    tree = RadixTree(PAGE)
    first = tree.insert(_key(1, 2), torch.arange(2, dtype=torch.int64))
    second = tree.insert(_key(1, 2, 3, 4), torch.arange(10, 14, dtype=torch.int64))
    leaf = tree._require_live(second.node)
    for name in TreeNode.__slots__:
        getattr(leaf, name)
    assert leaf.key == _key(3, 4)
    assert leaf.hit_count == 1
    assert leaf.last_access == tree._clock
    assert first.backups == (first.node,)
    assert second.backups == (first.node, second.node)
    assert tree._device_leaves.members == {leaf}
    stats = tree.statistics()
    assert (stats.num_nodes, stats.device_tokens, stats.evictable_device_tokens) == (2, 4, 4)
    tree.sanity_check()


def test_add_leaf_refuses_a_page_the_parent_has_a_child_for() -> None:
    """Guards against `add_leaf` replacing an existing child (its caller walked to a missing child first):
    a call for a page taken, or a position that is no whole page, raises and changes nothing."""
    tree = _tree_with(_key(1, 2))
    before = tree.statistics()
    with pytest.raises(ValueError, match="has a child"):
        _hicache_tree.add_leaf(tree, tree._root, _key(1, 2), 0, torch.arange(2), 1, [], 1)
    with pytest.raises(ValueError, match="whole pages"):
        _hicache_tree.add_leaf(tree, tree._root, _key(5, 6, 7), 0, torch.arange(2), 1, [], 1)
    assert tree.statistics() == before
    tree.sanity_check()


def test_insert_host_keeps_its_own_copy_and_checks_every_hash() -> None:
    """Guards against `insert_host`'s C copy sharing or misreading the caller's host indices (writing into
    them afterwards changes nothing) and against its one-pass hash check letting through a hash that is
    not 16 bytes (or not exactly `bytes`): such a refill raises and attaches nothing."""
    tree = RadixTree(PAGE)
    key = _key(1, 2, 3, 4)
    good = chained_page_hashes(key, PAGE, tree.namespace, ROOT_HASH)
    for bad in ([bytes(16), bytes(15)], [bytes(16), bytearray(16)]):
        with pytest.raises(TypeError, match="16-byte"):
            tree.insert_host(tree.root, key, torch.arange(4, dtype=torch.int64), bad)  # type: ignore[arg-type]
        assert tree.statistics().num_nodes == 0
    indices = torch.arange(100, 106, dtype=torch.int64)
    caller = indices[2:]  # a view at an offset into a larger storage
    result = tree.insert_host(tree.root, key, caller, good)
    expected = caller.clone()
    caller.fill_(-1)
    assert torch.equal(tree.node_info(result.node).host_value, expected)  # type: ignore[arg-type]
    tree.sanity_check()
