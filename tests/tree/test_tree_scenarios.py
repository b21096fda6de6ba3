"""Scenario tests of the radix tree core: one rule per test, read as a story."""

from __future__ import annotations

import logging

import pytest
import torch

from hicache.keys import ROOT_HASH, Namespace, as_key_bytes, chained_page_hashes
from hicache.tree import InsertResult, NodeRef, RadixTree

P = 4


def page_key(start: int, pages: int, page_size: int = P) -> list[int]:
    """`pages` pages of distinct tokens starting at `start`."""
    return list(range(start, start + pages * page_size))


def indices(start: int, n: int) -> torch.Tensor:
    """`n` consecutive pool indices from `start`."""
    return torch.arange(start, start + n, dtype=torch.int64)


def insert_device_chain(tree: RadixTree, key: list[int], first_index: int = 0) -> InsertResult:
    """Insert `key` with device indices `first_index ..`; check the tree stays sound."""
    result = tree.insert(key, indices(first_index, len(key)))
    tree.sanity_check()
    return result


def back_up(tree: RadixTree, node: NodeRef, first_host: int = 1000) -> None:
    """Run the whole backup chain of `node` to completion, root-first."""
    chain = tree.backup_chain(node)
    for i, n in enumerate(chain):
        tree.begin_backup(n, indices(first_host + 100 * i, tree.node_info(n).num_tokens))
    for n in chain:
        tree.commit_backup(n)
    tree.sanity_check()


def attach_host_child(
    tree: RadixTree, anchor: NodeRef, key: list[int], first_host: int = 5000
) -> InsertResult:
    """Attach a storage refill below `anchor`."""
    result = tree.insert_host(anchor, key, indices(first_host, len(key)))
    tree.sanity_check()
    return result


def test_match_on_an_empty_tree_finds_nothing_and_reports_the_root() -> None:
    """A miss must report empty indices and the root as both last nodes (the controller anchors there)."""
    tree = RadixTree(P)
    m = tree.match_prefix(page_key(0, 2))
    assert m.device_len == 0
    assert m.host_len == 0
    assert m.device_indices.numel() == 0
    assert m.last_device_node == tree.root
    assert m.last_host_node == tree.root
    assert m.host_nodes == ()


def test_insert_then_match_returns_the_same_indices_and_ignores_a_partial_page() -> None:
    """A trailing partial page is neither cached nor matched; the rest round-trips exactly."""
    tree = RadixTree(P)
    key = [*page_key(0, 3), 99, 98]
    r = insert_device_chain(tree, key, 10)
    assert (r.prefix_len, r.total_len) == (0, 12)
    m = tree.match_prefix(key)
    assert m.device_len == 12
    assert torch.equal(m.device_indices, indices(10, 12))
    assert len(m.key) == 12 * 8
    assert tree.statistics().device_tokens == 12


def test_second_insert_of_a_shared_prefix_reports_the_duplicate_length() -> None:
    """The caller frees `device_indices[:prefix_len]`: it must equal the tokens already on the device."""
    tree = RadixTree(P)
    insert_device_chain(tree, page_key(0, 2), 0)
    r = insert_device_chain(tree, page_key(0, 2) + page_key(100, 1), 50)
    assert r.prefix_len == 8
    assert r.total_len == 12
    m = tree.match_prefix(page_key(0, 2) + page_key(100, 1))
    assert torch.equal(m.device_indices, torch.cat([indices(0, 8), indices(58, 4)]))


def test_partial_match_splits_a_node_by_page_with_values_and_hashes() -> None:
    """A match ending inside a node splits keys, values, hashes; the upper part inherits the bookkeeping."""
    tree = RadixTree(P)
    r = insert_device_chain(tree, page_key(0, 3), 0)
    node = r.node
    back_up(tree, node)
    tree.lock_device(node)
    tree.set_priority(node, 7)
    m = tree.match_prefix(page_key(0, 1) + page_key(500, 1))
    assert m.device_len == 4
    upper = m.last_device_node
    assert upper == tree.node_info(node).parent
    assert tree.node_info(upper).num_tokens == 4
    assert tree.node_info(node).num_tokens == 8
    assert torch.equal(tree.node_info(upper).device_value, indices(0, 4))  # type: ignore[arg-type]
    assert torch.equal(tree.node_info(node).host_value, indices(1004, 8))  # type: ignore[arg-type]
    assert (
        tree.node_info(upper).device_lock,
        tree.node_info(upper).priority,
        tree.node_info(upper).hit_count,
    ) == (1, 7, tree.node_info(node).hit_count)
    full = chained_page_hashes(as_key_bytes(page_key(0, 3)), P, Namespace(), ROOT_HASH)
    assert tree.page_hashes(upper) + tree.page_hashes(node) == full
    tree.sanity_check()


def test_hit_counts_follow_sglang_every_matched_node_plus_one() -> None:
    """Selective write-through depends on insert hit counts: existing nodes +1, new nodes start at 1."""
    tree = RadixTree(P, write_policy="write_through_selective", write_through_threshold=2)
    r1 = insert_device_chain(tree, page_key(0, 2), 0)
    assert tree.node_info(r1.node).hit_count == 1
    assert r1.backups == ()
    r2 = insert_device_chain(tree, page_key(0, 2), 100)
    assert tree.node_info(r2.node).hit_count == 2
    assert r2.backups == (r2.node,)


def test_write_through_backs_up_new_nodes_at_once_and_write_back_never_at_insert() -> None:
    """The write policy decides which nodes an insert asks the controller to back up."""
    wt = RadixTree(P, write_policy="write_through")
    r = insert_device_chain(wt, page_key(0, 2))
    assert r.backups == (r.node,)
    wb = RadixTree(P, write_policy="write_back")
    r = insert_device_chain(wb, page_key(0, 2))
    assert r.backups == ()
    assert wb.node_info(r.node).hit_count == 0


def test_backup_chain_runs_root_first_from_the_topmost_unbacked_ancestor() -> None:
    """A child cannot be backed up before its parent under write-through: the chain includes the parent."""
    tree = RadixTree(P, write_policy="write_through_selective", write_through_threshold=5)
    parent = insert_device_chain(tree, page_key(0, 2)).node
    child = insert_device_chain(tree, page_key(0, 2) + page_key(50, 1), 100).node
    assert tree.backup_chain(child) == [parent, child]
    tree.begin_backup(parent, indices(1000, 8))
    assert tree.backup_chain(child) == [child]
    assert tree.backup_chain(parent) == []


def test_commit_refuses_a_child_before_its_parent_under_write_through() -> None:
    """Committing out of order would break "backed up only if the parent is"; it must be refused."""
    tree = RadixTree(P, write_policy="write_through")
    parent = insert_device_chain(tree, page_key(0, 2)).node
    child = insert_device_chain(tree, page_key(0, 2) + page_key(50, 1), 100).node
    tree.begin_backup(parent, indices(1000, 8))
    tree.begin_backup(child, indices(2000, 4))
    with pytest.raises(ValueError, match="root-first"):
        tree.commit_backup(child)
    tree.sanity_check()
    tree.commit_backup(parent)
    tree.commit_backup(child)
    assert tree.node_info(child).backed_up
    tree.sanity_check()


def test_pending_backup_protects_the_path_from_eviction_and_abort_returns_the_host_indices() -> None:
    """Pages being copied must not be freed under the copy; an abort hands the host indices back."""
    tree = RadixTree(P)
    node = insert_device_chain(tree, page_key(0, 2)).node
    tree.begin_backup(node, indices(1000, 8))
    assert tree.evict_device(100).evicted_tokens == 0
    assert tree.statistics().pending_backup_tokens == 8
    freed = tree.abort_backup(node)
    assert torch.equal(freed.freed_host, indices(1000, 8))
    tree.sanity_check()
    assert tree.evict_device(100).evicted_tokens == 8


def test_a_node_split_while_its_backup_is_in_flight_commits_as_a_whole() -> None:
    """The controller only knows the node it began; the split-off upper part must commit with it."""
    tree = RadixTree(P)
    node = insert_device_chain(tree, page_key(0, 3)).node
    tree.begin_backup(node, indices(1000, 12))
    tree.match_prefix(page_key(0, 1))
    upper = tree.node_info(node).parent
    assert upper is not None
    assert upper != tree.root
    tree.sanity_check()
    tree.commit_backup(node)
    assert tree.node_info(upper).backed_up
    assert tree.node_info(node).backed_up
    assert torch.equal(
        torch.cat([tree.node_info(upper).host_value, tree.node_info(node).host_value]), indices(1000, 12)
    )  # type: ignore[list-item]
    tree.sanity_check()


def test_lru_eviction_demotes_backed_up_leaves_and_deletes_unbacked_ones() -> None:
    """Backed-up leaves keep their host copy; un-backed leaves disappear (write-through)."""
    tree = RadixTree(P)
    a = insert_device_chain(tree, page_key(0, 1), 0).node
    b = insert_device_chain(tree, page_key(100, 1), 10).node
    back_up(tree, a)
    tree.match_prefix(page_key(100, 1))  # b is now more recent than a
    r = tree.evict_device(4)
    assert torch.equal(r.freed_device, indices(0, 4))
    assert tree.node_info(a).evicted
    assert tree.node_info(a).backed_up
    r = tree.evict_device(4)
    assert torch.equal(r.freed_device, indices(10, 4))
    assert not tree.is_live(b)
    tree.sanity_check()
    m = tree.match_prefix(page_key(0, 1))
    assert (m.device_len, m.host_len, m.host_nodes) == (0, 4, (a,))


def test_demoting_a_leaf_makes_its_parent_the_next_device_leaf() -> None:
    """Leaf sets are kept incrementally: after demoting a child the parent must be evictable next."""
    tree = RadixTree(P)
    parent = insert_device_chain(tree, page_key(0, 1)).node
    child = insert_device_chain(tree, page_key(0, 1) + page_key(50, 1), 4).node
    back_up(tree, child)
    r = tree.evict_device(8)
    assert r.evicted_tokens == 8
    assert tree.node_info(parent).evicted
    assert tree.node_info(child).evicted
    tree.sanity_check()


def test_lfu_and_priority_policies_order_leaves() -> None:
    """LFU evicts the least hit leaf first; PRIORITY the lowest priority first."""
    lfu = RadixTree(P, eviction_policy="lfu")
    cold = insert_device_chain(lfu, page_key(0, 1), 0).node
    insert_device_chain(lfu, page_key(100, 1), 10)
    insert_device_chain(lfu, page_key(100, 1), 20)
    lfu.match_prefix(page_key(0, 1))
    assert torch.equal(lfu.evict_device(1).freed_device, indices(0, 4))
    assert not lfu.is_live(cold)
    prio = RadixTree(P, eviction_policy="priority")
    low = insert_device_chain(prio, page_key(0, 1), 0).node
    high = insert_device_chain(prio, page_key(100, 1), 10).node
    prio.set_priority(low, 10)
    prio.set_priority(high, 1)
    prio.evict_device(1)
    assert not prio.is_live(high)
    assert prio.node_info(low).parent == prio.root
    prio.sanity_check()


def test_device_lock_protects_a_node_and_its_ancestors_and_unlock_below_zero_is_misuse() -> None:
    """A running request's prefix must never be evicted; unbalanced unlocks are a caller bug."""
    tree = RadixTree(P)
    parent = insert_device_chain(tree, page_key(0, 1)).node
    child = insert_device_chain(tree, page_key(0, 1) + page_key(50, 1), 4).node
    tree.lock_device(child)
    assert (tree.node_info(parent).device_lock, tree.node_info(child).device_lock) == (1, 1)
    s = tree.statistics()
    assert (s.protected_device_tokens, s.evictable_device_tokens) == (8, 0)
    assert tree.evict_device(100).evicted_tokens == 0
    tree.unlock_device(child)
    with pytest.raises(ValueError, match="not device-locked"):
        tree.unlock_device(child)
    tree.sanity_check()


def test_host_lock_protects_the_anchor_from_host_eviction() -> None:
    """A prefetch anchor must not be evicted from the host while its refill is streaming."""
    tree = RadixTree(P)
    node = insert_device_chain(tree, page_key(0, 1)).node
    back_up(tree, node)
    tree.evict_device(4)
    tree.lock_host(node)
    assert tree.evict_host(100).evicted_tokens == 0
    tree.unlock_host(node)
    with pytest.raises(ValueError, match="not host-locked"):
        tree.unlock_host(node)
    r = tree.evict_host(100)
    assert torch.equal(r.freed_host, indices(1000, 4))
    assert tree.statistics().num_nodes == 0
    tree.sanity_check()


def test_host_eviction_removes_leaves_then_their_parents() -> None:
    """A parent that becomes a host-only leaf is the next host eviction candidate."""
    tree = RadixTree(P)
    insert_device_chain(tree, page_key(0, 1))
    child = insert_device_chain(tree, page_key(0, 1) + page_key(50, 1), 4).node
    back_up(tree, child)
    tree.evict_device(8)
    r = tree.evict_host(8)
    assert r.evicted_tokens == 8
    assert tree.statistics().num_nodes == 0
    tree.sanity_check()


def test_insert_reattaches_device_values_to_host_only_nodes() -> None:
    """Re-inserting an evicted prefix gives it device data again instead of counting a duplicate."""
    tree = RadixTree(P)
    node = insert_device_chain(tree, page_key(0, 2)).node
    back_up(tree, node)
    tree.evict_device(8)
    r = insert_device_chain(tree, page_key(0, 2) + page_key(50, 1), 100)
    assert r.prefix_len == 0
    assert torch.equal(tree.node_info(node).device_value, indices(100, 8))  # type: ignore[arg-type]
    assert tree.match_prefix(page_key(0, 2) + page_key(50, 1)).device_len == 12


def test_load_back_attaches_device_values_root_first() -> None:
    """`attach_device` needs the parent on the device: loads go root-first."""
    tree = RadixTree(P)
    parent = insert_device_chain(tree, page_key(0, 1)).node
    child = insert_device_chain(tree, page_key(0, 1) + page_key(50, 1), 4).node
    back_up(tree, child)
    tree.evict_device(8)
    with pytest.raises(ValueError, match="not on the device"):
        tree.attach_device(child, indices(300, 4))
    tree.attach_device(parent, indices(200, 4))
    tree.attach_device(child, indices(300, 4))
    m = tree.match_prefix(page_key(0, 1) + page_key(50, 1))
    assert torch.equal(m.device_indices, torch.cat([indices(200, 4), indices(300, 4)]))
    tree.sanity_check()


def test_demote_refuses_locked_unbacked_or_parent_of_device_child() -> None:
    """Demoting is only legal for an unlocked backed-up node without device children."""
    tree = RadixTree(P)
    parent = insert_device_chain(tree, page_key(0, 1)).node
    child = insert_device_chain(tree, page_key(0, 1) + page_key(50, 1), 4).node
    with pytest.raises(ValueError, match="not backed up"):
        tree.demote(child)
    back_up(tree, child)
    with pytest.raises(ValueError, match="child on the device"):
        tree.demote(parent)
    tree.lock_device(child)
    with pytest.raises(ValueError, match="device-locked"):
        tree.demote(child)
    tree.unlock_device(child)
    assert torch.equal(tree.demote(child).freed_device, indices(8, 4))
    tree.sanity_check()


def test_seed_refill_under_unbacked_parent_is_dropped_under_write_through(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """SGLang PR #31902: a storage refill hung below an un-backed device-only parent broke the
    write-through invariant and later eviction. It must be dropped, leaving the parent childless."""
    tree = RadixTree(P, write_policy="write_through")
    parent = insert_device_chain(tree, page_key(0, 10)).node
    with caplog.at_level(logging.INFO, logger="hicache.tree"):
        r = tree.insert_host(parent, page_key(500, 2), indices(7000, 8))
    assert r.host_insert_dropped
    assert (r.prefix_len, r.node) == (0, parent)
    assert tree.node_info(parent).children == ()
    assert any(
        "dropped 8" in rec.getMessage() and f"node {parent.id}" in rec.getMessage() for rec in caplog.records
    )
    tree.sanity_check()
    assert tree.evict_device(10 * P).evicted_tokens == 40
    tree.sanity_check()


def test_seed_refill_under_unbacked_parent_is_attached_under_write_back() -> None:
    """Write-back has no backup-continuity invariant: the refill is attached."""
    tree = RadixTree(P, write_policy="write_back")
    parent = insert_device_chain(tree, page_key(0, 10)).node
    r = attach_host_child(tree, parent, page_key(500, 2))
    assert not r.host_insert_dropped
    assert tree.node_info(r.node).parent == parent
    assert tree.node_info(r.node).host_value is not None
    assert tree.match_prefix(page_key(0, 10) + page_key(500, 2)).host_len == 8


def test_seed_refill_attaches_once_the_parent_is_backed_up() -> None:
    """After the parent's backup commits, the same refill attaches and matching reports the host hit."""
    tree = RadixTree(P, write_policy="write_through")
    parent = insert_device_chain(tree, page_key(0, 10)).node
    back_up(tree, parent)
    r = attach_host_child(tree, parent, page_key(500, 2))
    assert not r.host_insert_dropped
    assert (r.prefix_len, r.total_len) == (0, 8)
    m = tree.match_prefix(page_key(0, 10) + page_key(500, 2))
    assert (m.device_len, m.host_len) == (40, 8)
    assert m.host_nodes == (r.node,)
    assert m.last_host_node == r.node


def test_refill_of_already_cached_tokens_reports_the_existing_node() -> None:
    """The caller frees `host_indices[:prefix_len]`; a fully present refill reports all of it."""
    tree = RadixTree(P)
    parent = insert_device_chain(tree, page_key(0, 1)).node
    back_up(tree, parent)
    first = attach_host_child(tree, parent, page_key(500, 2))
    again = attach_host_child(tree, parent, page_key(500, 2), 9000)
    assert (again.prefix_len, again.total_len, again.node) == (8, 8, first.node)
    partly = attach_host_child(tree, parent, page_key(500, 2) + page_key(900, 1), 9500)
    assert (partly.prefix_len, partly.total_len) == (8, 12)


def test_refill_uses_precomputed_hashes_and_validates_their_count() -> None:
    """Hashes computed by the storage layer are reused; a wrong count is a caller bug."""
    tree = RadixTree(P)
    parent = insert_device_chain(tree, page_key(0, 1)).node
    back_up(tree, parent)
    key = page_key(500, 2)
    hashes = chained_page_hashes(as_key_bytes(key), P, Namespace(), tree.last_hash(parent))
    with pytest.raises(ValueError, match="hashes"):
        tree.insert_host(parent, key, indices(7000, 8), hashes[:1])
    r = tree.insert_host(parent, key, indices(7000, 8), hashes)
    assert tree.page_hashes(r.node) == hashes
    tree.sanity_check()


def test_insert_host_needs_a_live_anchor() -> None:
    """An anchor evicted meanwhile must not be written below."""
    tree = RadixTree(P)
    node = insert_device_chain(tree, page_key(0, 1)).node
    tree.evict_device(4)
    with pytest.raises(ValueError, match="anchor"):
        tree.insert_host(node, page_key(500, 1), indices(7000, 4))


def test_write_back_eviction_asks_for_backups_while_host_room_lasts_then_drops() -> None:
    """Write-back leaves are backed up on eviction when the host has room, dropped beyond it."""
    tree = RadixTree(P, write_policy="write_back")
    a = insert_device_chain(tree, page_key(0, 1), 0).node
    b = insert_device_chain(tree, page_key(100, 1), 10).node
    r = tree.evict_device(8, host_free_tokens=4)
    assert r.backup_first == (a,)
    assert torch.equal(r.freed_device, indices(10, 4))
    assert r.evicted_tokens == 8
    assert not tree.is_live(b)
    assert tree.node_info(a).device_value is not None
    tree.sanity_check()


def shared_prefix_with_two_children(tree: RadixTree) -> tuple[NodeRef, NodeRef, NodeRef]:
    """A 4-page parent with two 2-page children (issue 10's repro at page size 4): parent, a, b."""
    a = insert_device_chain(tree, page_key(0, 4) + page_key(100, 2), 0).node
    b = insert_device_chain(tree, page_key(0, 4) + page_key(200, 2), 100).node
    parent = tree.node_info(a).parent
    assert parent is not None
    assert parent == tree.node_info(b).parent
    return parent, a, b


def test_write_back_plan_counts_the_whole_unbacked_chain() -> None:
    """A backup needs its leaf's un-backed ancestors too: with room for the parent and one child, the
    first child's chain takes the parent; the second child's chain is then only itself."""
    tree = RadixTree(P, write_policy="write_back", eviction_policy="lru")
    parent, a, b = shared_prefix_with_two_children(tree)
    r = tree.evict_device(16, host_free_tokens=32)
    assert r.backups == ((parent, a), (b,))
    assert r.backup_tokens == 32
    assert r.dropped_tokens == 0
    assert r.freed_device.numel() == 0
    tree.sanity_check()


def test_write_back_drops_leaves_whose_chain_does_not_fit_then_backs_up_the_parent() -> None:
    """The reported stall: room for each child alone but not for its chain. The children are dropped,
    and the parent, a leaf now, fits: it is backed up instead of nothing moving at all."""
    tree = RadixTree(P, write_policy="write_back")
    parent, a, b = shared_prefix_with_two_children(tree)
    r = tree.evict_device(32, host_free_tokens=16)
    assert r.backups == ((parent,),)
    assert r.backup_tokens == 16
    assert r.dropped_tokens == 16
    assert torch.equal(r.freed_device.sort().values, torch.cat([indices(16, 8), indices(116, 8)]))
    assert not tree.is_live(a)
    assert not tree.is_live(b)
    assert r.evicted_tokens == 32
    tree.sanity_check()


def test_write_back_plan_never_promises_more_than_the_room() -> None:
    """Without host room nothing is promised: every un-backed leaf is dropped, the tree emptied."""
    tree = RadixTree(P, write_policy="write_back")
    shared_prefix_with_two_children(tree)
    r = tree.evict_device(1000, host_free_tokens=4)
    assert r.backups == ()
    assert r.dropped_tokens == r.evicted_tokens == 32
    assert tree.statistics().num_nodes == 0
    tree.sanity_check()


def test_write_back_host_locked_leaf_is_backed_up_or_kept_never_dropped() -> None:
    """Dropping a host-locked leaf would free pages its holder reads: backed up if it fits, else kept."""
    tree = RadixTree(P, write_policy="write_back")
    leaf = insert_device_chain(tree, page_key(0, 2)).node
    tree.lock_host(leaf)
    r = tree.evict_device(8, host_free_tokens=4)
    assert r.evicted_tokens == 0
    assert r.backups == ()
    r = tree.evict_device(8, host_free_tokens=8)
    assert r.backups == ((leaf,),)
    tree.unlock_host(leaf)
    tree.sanity_check()


def test_a_leaf_with_two_heap_entries_is_planned_once() -> None:
    """A priority change leaves a second heap entry; the plan must not back the leaf up twice."""
    tree = RadixTree(P, write_policy="write_back")
    leaf = insert_device_chain(tree, page_key(0, 1)).node
    tree.set_priority(leaf, 0)
    r = tree.evict_device(8, host_free_tokens=8)
    assert r.backups == ((leaf,),)
    assert r.backup_tokens == 4
    tree.sanity_check()


def test_reclaimable_host_tokens_count_only_what_evict_host_frees() -> None:
    """Host room for backups: host-only, unlocked nodes. A device node's host copy, a host-locked or a
    device-locked host-only node's, is host data that `evict_host` cannot free."""
    tree = RadixTree(P)
    parent = insert_device_chain(tree, page_key(0, 2)).node
    back_up(tree, parent)
    refill = attach_host_child(tree, parent, page_key(300, 1)).node
    stats = tree.statistics()
    assert stats.host_tokens == 12
    assert stats.reclaimable_host_tokens == 4  # the refill; the parent is on the device
    tree.lock_host(refill)
    assert tree.statistics().reclaimable_host_tokens == 0
    assert tree.evict_host(100).evicted_tokens == 0
    tree.unlock_host(refill)
    tree.evict_device(8)  # demotes the parent: host-only now
    assert tree.statistics().reclaimable_host_tokens == 12
    tree.lock_device(refill)  # (a prefetch anchor on the host) protects the path from host eviction too
    assert tree.statistics().reclaimable_host_tokens == 0
    assert tree.evict_host(100).evicted_tokens == 0
    tree.unlock_device(refill)
    assert tree.evict_host(100).evicted_tokens == 12
    assert tree.statistics().reclaimable_host_tokens == 0
    tree.sanity_check()


def test_write_back_drop_frees_host_pages_of_the_subtree() -> None:
    """Dropping an un-backed write-back leaf also frees refills hung below it."""
    tree = RadixTree(P, write_policy="write_back")
    parent = insert_device_chain(tree, page_key(0, 1)).node
    attach_host_child(tree, parent, page_key(500, 1), 7000)
    r = tree.evict_device(4)
    assert torch.equal(r.freed_device, indices(0, 4))
    assert torch.equal(r.freed_host, indices(7000, 4))
    assert tree.statistics().num_nodes == 0
    tree.sanity_check()


def test_eviction_stops_when_nothing_is_evictable() -> None:
    """Running out of evictable pages is a value, not an exception."""
    tree = RadixTree(P)
    insert_device_chain(tree, page_key(0, 1))
    r = tree.evict_device(1000)
    assert r.evicted_tokens == 4
    assert tree.evict_device(1000).evicted_tokens == 0
    assert tree.evict_host(1000).evicted_tokens == 0


def test_statistics_and_repr_are_informative() -> None:
    """State is observable: counters and reprs name what the tree holds."""
    tree = RadixTree(P)
    node = insert_device_chain(tree, page_key(0, 2)).node
    s = tree.statistics()
    assert s.num_nodes == 1
    assert s.device_tokens == s.evictable_device_tokens == 8
    assert "device=8" in repr(s)
    assert "page_size=4" in repr(tree)
    assert f"id={node.id}" in repr(node)
    assert "num_tokens=8" in repr(tree.node_info(node))
    assert torch.equal(tree.device_tokens_owned(), indices(0, 8))


def test_hashes_chain_from_the_parent_and_the_namespace() -> None:
    """Page hashes name pages in storage: they must chain across nodes and depend on the namespace."""
    a = RadixTree(P, namespace=Namespace(model_id="a"))
    b = RadixTree(P, namespace=Namespace(model_id="b"))
    key = page_key(0, 2) + page_key(50, 1)
    for t in (a, b):
        insert_device_chain(t, page_key(0, 2))
        insert_device_chain(t, key)
    na = a.match_prefix(key).last_device_node
    nb = b.match_prefix(key).last_device_node
    assert a.page_hashes(na) != b.page_hashes(nb)
    parent = a.node_info(na).parent
    assert parent is not None
    assert a.page_hashes(parent) + a.page_hashes(na) == chained_page_hashes(
        as_key_bytes(key), P, Namespace(model_id="a")
    )


def test_sanity_check_reports_every_violation() -> None:
    """A corrupted tree must list all its problems at once."""
    from hicache.errors import InvariantViolation

    tree = RadixTree(P)
    node = tree._require_live(insert_device_chain(tree, page_key(0, 2)).node)  # white-box: corrupt it
    node.device_lock = -1
    node.device_value = indices(0, 3)
    with pytest.raises(InvariantViolation) as info:
        tree.sanity_check()
    text = "\n".join(info.value.violations)
    assert "negative lock" in text
    assert "3 entries for 8 tokens" in text
    assert len(info.value.violations) >= 3


def test_cached_joined_path_follows_demotion_reload_and_split() -> None:
    """`device_indices(node)` caches the joined device indices on the node; the cache must never outlive
    the values, and reading a match result caches nothing (results are plain data).

    Guards against a stale join: after the path is demoted and loaded back at other device indices, or
    split by a shorter match, every match must return the indices the nodes hold now.
    """
    tree = RadixTree(P)
    insert_device_chain(tree, page_key(0, 2), 0)
    leaf = insert_device_chain(tree, page_key(0, 2) + page_key(100, 2), 50).node
    key = page_key(0, 2) + page_key(100, 2)
    first = tree.match_prefix(key)
    expected = torch.cat([indices(0, 8), indices(58, 8)])
    assert torch.equal(first.device_indices, expected)
    assert tree.match_prefix(key).device_indices is not first.device_indices  # the read cached nothing
    joined = tree.device_indices(first.last_device_node)
    assert torch.equal(joined, expected)
    assert tree.statistics().device_tokens == 16
    again = tree.match_prefix(key)
    assert again.device_indices is joined  # served from the cache, not joined again
    tree.sanity_check()

    back_up(tree, leaf)
    upper = tree.node_info(leaf).parent
    assert upper is not None
    tree.demote(leaf)
    tree.demote(upper)
    tree.sanity_check()
    reloaded = tree.match_prefix(key)
    assert reloaded.device_len == 0
    assert [n.id for n in reloaded.host_nodes] == [upper.id, leaf.id]
    tree.attach_device(upper, indices(200, 8))
    tree.attach_device(leaf, indices(300, 8))
    m = tree.match_prefix(key)
    assert torch.equal(m.device_indices, torch.cat([indices(200, 8), indices(300, 8)]))
    assert torch.equal(tree.device_indices(leaf), torch.cat([indices(200, 8), indices(300, 8)]))
    tree.sanity_check()

    shorter = tree.match_prefix(page_key(0, 2) + page_key(100, 1))  # splits the leaf
    assert torch.equal(shorter.device_indices, torch.cat([indices(200, 8), indices(300, 4)]))
    assert torch.equal(
        tree.device_indices(shorter.last_device_node), torch.cat([indices(200, 8), indices(300, 4)])
    )
    assert torch.equal(tree.match_prefix(key).device_indices, torch.cat([indices(200, 8), indices(300, 8)]))
    assert torch.equal(tree.device_indices(leaf), torch.cat([indices(200, 8), indices(300, 8)]))
    tree.sanity_check()


@pytest.mark.parametrize("bad", [[b"x" * 16, b"y" * 15], [b"x" * 16, bytearray(16)], (b"x" * 16, b"y" * 16)])
def test_refill_refuses_hashes_that_are_not_a_list_of_16_byte_hashes(bad: object) -> None:
    """A wrong-sized hash, one that is not bytes, or a tuple is refused before the tree changes."""
    tree = RadixTree(P)
    parent = insert_device_chain(tree, page_key(0, 1)).node
    back_up(tree, parent)
    with pytest.raises(TypeError, match="hashes"):
        tree.insert_host(parent, page_key(500, 2), indices(7000, 8), bad)  # type: ignore[arg-type]
    match = tree.match_prefix(page_key(0, 1) + page_key(500, 2))
    assert match.device_len + match.host_len == 4  # nothing of the refill attached
    tree.sanity_check()
