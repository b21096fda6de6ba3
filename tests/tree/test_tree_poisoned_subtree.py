"""Nodes below a poisoned node (a failed load-back's node a holder kept on the device): whatever is inserted
there (a computed key, a storage refill) is never served while the poison lasts, is served again once it
clears, and eviction takes the poisoned node and its subtree without breaking an invariant. A match through
a poisoned node touches no LRU clock past it."""

from __future__ import annotations

import pytest
import torch

from hicache.tree import NodeRef, RadixTree
from tests.tree.test_tree_failed_load import (
    CHILD,
    CHILD_KEY,
    KEY,
    LOADED,
    P,
    evict_all,
    host_only_chain_loaded,
    ids,
    insert_device_child,
    page_key,
    release_load_locks,
)

SIBLING_KEY = KEY + page_key(800, 1)
"""A key through the poisoned node to a page beside the held child."""
SIBLING = ids(440, 4)


def poison_under_a_held_child(tree: RadixTree) -> tuple[NodeRef, NodeRef]:
    """KEY's load-back fails while a lease holds the device-only child below it: the loaded node stays on
    the device, poisoned. The lease and the load let go afterwards. Returns (poisoned node, child)."""
    host_only_chain_loaded(tree)
    child = insert_device_child(tree)
    tree.lock_device(child)
    freed, (poisoned,) = tree.drop_failed_load(KEY, 0, LOADED)
    assert freed.freed_device.numel() == 0
    tree.unlock_device(child)
    release_load_locks(tree, poisoned)
    tree.sanity_check()
    assert tree.poisoned(poisoned)
    return poisoned, child


def assert_unserved(tree: RadixTree, key: list[int]) -> None:
    """Neither a match nor a peek of `key` reaches the poisoned node or anything below it."""
    match = tree.match_prefix(key)
    assert (match.device_len, match.host_len) == (0, 0)
    assert match.host_nodes == ()
    assert not bool(torch.isin(LOADED, match.device_indices).any())
    peek = tree.peek(key)
    assert (peek.device_len, peek.host_len, peek.anchor_len) == (0, 0, 0)


def assert_index_sets(tree: RadixTree, freed: list[torch.Tensor], handed: torch.Tensor) -> None:
    """Every device index handed to the tree is held by it or was freed, exactly once."""
    held = tree.device_tokens_owned()
    both = torch.cat([held, *freed])
    assert torch.equal(torch.sort(both).values, torch.unique(both)), "an index held and freed, or freed twice"
    assert set(both.tolist()) == set(handed.tolist())


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_a_key_inserted_below_a_poisoned_node_is_served_only_once_the_poison_clears(policy: str) -> None:
    """Guards against an insert reopening the failed pages: a request that computed a key through the
    poisoned node inserts it; the poisoned node counts as already cached (the caller frees its own copy
    of that span, the tree keeps the failed pages), the rest hangs below it unserved; once the copy again
    landed (`clear_poison`) the new node is a hit through the recopied pages."""
    tree = RadixTree(P, write_policy=policy)
    poisoned, _ = poison_under_a_held_child(tree)
    recopied = tree.node_info(poisoned).device_value
    inserted = tree.insert(SIBLING_KEY, torch.cat([ids(600, 16), SIBLING]))
    assert inserted.prefix_len == 16  # the caller frees ids(600, 16)
    tree.sanity_check()
    assert_unserved(tree, SIBLING_KEY)
    assert_unserved(tree, CHILD_KEY)
    assert tree.clear_poison(KEY, 0, recopied) == 1
    tree.sanity_check()
    match = tree.match_prefix(SIBLING_KEY)
    assert match.device_len == 20
    assert torch.equal(match.device_indices, torch.cat([LOADED, SIBLING]))
    assert tree.peek(CHILD_KEY).device_len == 20


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_an_insert_below_a_poisoned_node_then_eviction_keeps_every_invariant(policy: str) -> None:
    """The poisoned node cannot leave while a node inserted below it is on the device: eviction takes the
    device nodes below first, then the poisoned node's device pages (it keeps its host copy, unpoisoned);
    every device index comes back once and the prefix is a host hit again."""
    tree = RadixTree(P, write_policy=policy)
    poisoned, child = poison_under_a_held_child(tree)
    tree.insert(SIBLING_KEY, torch.cat([ids(600, 16), SIBLING]))
    gone = evict_all(tree)
    tree.sanity_check()
    assert_index_sets(tree, [gone], torch.cat([LOADED, CHILD, SIBLING]))
    assert tree.device_tokens_owned().numel() == 0
    assert tree.statistics().device_tokens == 0
    assert not tree.poisoned(poisoned)
    assert not tree.is_live(child)
    match = tree.match_prefix(KEY)
    assert (match.device_len, match.host_len) == (0, 16)


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_a_refill_below_a_poisoned_node_is_unserved_then_a_host_hit_once_it_is_evicted(policy: str) -> None:
    """Guards against a storage refill (a prefetch's commit, `insert_host`) reopening the failed pages: the
    refill of a key through the poisoned node counts its span as present and hangs the rest below it as a
    host-only node, which no match or peek reaches; once eviction takes the poisoned node's device pages
    (the child below it first), the refill is a host hit below the host copy."""
    tree = RadixTree(P, write_policy=policy)
    poisoned, _ = poison_under_a_held_child(tree)
    refill = tree.insert_host(tree.root, SIBLING_KEY, ids(5000, 20))
    assert not refill.host_insert_dropped
    assert refill.prefix_len == 16  # the caller frees host ids(5000, 16)
    tree.sanity_check()
    assert_unserved(tree, SIBLING_KEY)
    gone = evict_all(tree)
    tree.sanity_check()
    assert_index_sets(tree, [gone], torch.cat([LOADED, CHILD]))
    assert not tree.poisoned(poisoned)
    match = tree.match_prefix(SIBLING_KEY)
    assert (match.device_len, match.host_len) == (0, 20)
    assert torch.equal(match.host_indices[16:], ids(5016, 4))


def test_a_refill_below_a_poisoned_node_is_served_once_the_poison_clears() -> None:
    """The refill hung below the poisoned node is a host hit below the recopied pages once they landed."""
    tree = RadixTree(P)
    poisoned, _ = poison_under_a_held_child(tree)
    recopied = tree.node_info(poisoned).device_value
    tree.insert_host(tree.root, SIBLING_KEY, ids(5000, 20))
    assert tree.clear_poison(KEY, 0, recopied) == 1
    tree.sanity_check()
    match = tree.match_prefix(SIBLING_KEY)
    assert (match.device_len, match.host_len) == (16, 4)
    assert torch.equal(match.device_indices, LOADED)
    assert tree.peek(SIBLING_KEY).anchor_len == 20


def test_a_match_through_a_poisoned_node_touches_nothing_past_it() -> None:
    """Guards against matches keeping unreturned nodes on the device: a match of the child's key used to
    advance the LRU clock of the poisoned node and the child below it though it returns neither, so an
    unrelated leaf inserted after them was evicted first. The child's access time stays, and it goes
    first."""
    tree = RadixTree(P)
    poisoned, child = poison_under_a_held_child(tree)
    other_key = page_key(3000, 1)
    tree.insert(other_key, ids(700, 4))  # touched after the child
    before = {ref: tree.node_info(ref).last_access for ref in (poisoned, child)}
    for _ in range(3):
        assert tree.match_prefix(CHILD_KEY).device_len == 0
    tree.sanity_check()
    assert {ref: tree.node_info(ref).last_access for ref in (poisoned, child)} == before
    assert torch.equal(tree.evict_device(4).freed_device, CHILD)
    assert tree.match_prefix(other_key).device_len == 4
    tree.sanity_check()


def test_a_failed_load_whose_path_left_the_tree_frees_nothing() -> None:
    """The walk of `drop_failed_load` stops where the key's cached path ends (a live branch: a caller's
    key that the tree does not hold), handing back nothing and changing nothing."""
    tree = RadixTree(P)
    tree.insert(page_key(0, 1), ids(0, 4))
    freed, kept = tree.drop_failed_load(KEY, 0, LOADED)
    assert (freed.freed_device.numel(), kept) == (0, ())
    assert tree.match_prefix(page_key(0, 1)).device_len == 4
    tree.sanity_check()
