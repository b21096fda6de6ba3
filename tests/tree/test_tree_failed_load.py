"""`drop_failed_load`: the pages of a load-back whose copy failed leave the device tier whatever locks them,
with the device subtree below them (device prefix continuity), and come back once to be freed; a
device-only node that a holder keeps below them keeps them too, and is reported."""

from __future__ import annotations

import pytest
import torch

from hicache.tree import NodeRef, RadixTree

P = 4


def page_key(start: int, pages: int) -> list[int]:
    return list(range(start, start + pages * P))


def ids(start: int, n: int) -> torch.Tensor:
    return torch.arange(start, start + n, dtype=torch.int64)


KEY = page_key(0, 2) + page_key(50, 2)
LOADED = ids(200, 16)


def host_only_chain_loaded(tree: RadixTree) -> None:
    """KEY on the host only, then loaded back into LOADED (attached before its copy landed) and locked
    as the load and a lease lock it."""
    leaf = tree.insert(KEY, ids(0, 16)).node
    chain = tree.backup_chain(leaf)
    for i, n in enumerate(chain):
        tree.begin_backup(n, ids(1000 + 100 * i, tree.node_info(n).num_tokens))
    for n in chain:
        tree.commit_backup(n)
    assert tree.evict_device(16).freed_device.numel() == 16
    attached = tree.attach_loaded(KEY, 0, LOADED)
    assert attached.match.device_len == 16
    tree.lock_device(attached.match.last_device_node)  # the load
    tree.lock_device(attached.match.last_device_node)  # a lease on it


def test_locked_loaded_nodes_split_meanwhile_leave_the_device_tier() -> None:
    """Locks do not keep bad pages: both halves of a loaded node split after the attach lose their device
    values, every loaded index comes back once, the host copies and the locks stay."""
    tree = RadixTree(P)
    host_only_chain_loaded(tree)
    tree.match_prefix(page_key(0, 1) + page_key(700, 1))  # splits the first loaded node
    freed, kept = tree.drop_failed_load(KEY, 0, LOADED)
    assert kept == ()
    assert torch.equal(torch.sort(freed.freed_device).values, LOADED)
    match = tree.match_prefix(KEY)
    assert (match.device_len, match.host_len) == (0, 16)
    tree.sanity_check()
    leaf = match.host_nodes[-1]
    tree.unlock_device(leaf)
    tree.unlock_device(leaf)
    tree.sanity_check()


def test_an_unlocked_device_child_inserted_below_goes_too() -> None:
    """A device-only child inserted below the loaded pages must leave with them: unlocked, it leaves the
    tree and its pages come back too."""
    tree = RadixTree(P)
    host_only_chain_loaded(tree)
    child = tree.insert(CHILD_KEY, torch.cat([LOADED, CHILD])).node
    freed, kept = tree.drop_failed_load(KEY, 0, LOADED)
    tree.sanity_check()
    assert kept == ()
    assert torch.equal(torch.sort(freed.freed_device).values, torch.cat([LOADED, CHILD]))
    assert not tree.is_live(child)
    assert tree.match_prefix(KEY).device_len == 0


CHILD_KEY = KEY + page_key(900, 1)
CHILD = ids(400, 4)


def insert_device_child(tree: RadixTree) -> NodeRef:
    """A request that computed KEY and a page beyond it inserts them: the loaded pages are duplicates,
    the page beyond becomes a device-only child (its KV is its own: computed, not read from the load)."""
    return tree.insert(CHILD_KEY, torch.cat([ids(600, 16), CHILD])).node


def assert_nothing_reads_the_failed_pages(tree: RadixTree) -> None:
    """No match or peek of the key or below it reaches the failed (poisoned) pages."""
    for key in (KEY, CHILD_KEY, KEY[:8]):
        match = tree.match_prefix(key)
        assert match.device_len == 0, key
        assert match.host_len == 0, key
        assert not bool(torch.isin(LOADED, match.device_indices).any())
        peek = tree.peek(key)
        assert (peek.device_len, peek.host_len) == (0, 0)


def assert_every_index_accounted(tree: RadixTree, freed: torch.Tensor) -> None:
    """Every device index handed to the tree is either still held by it or was freed, exactly once."""
    held = tree.device_tokens_owned()
    both = torch.sort(torch.cat([held, freed])).values
    assert torch.equal(both, torch.unique(both)), "an index both held and freed, or freed twice"
    assert set(both.tolist()) == set(torch.cat([LOADED, CHILD]).tolist())


def release_load_locks(tree: RadixTree, loaded: NodeRef) -> None:
    """The load and the lease on the loaded node let go (`host_only_chain_loaded` took two locks)."""
    tree.unlock_device(loaded)
    tree.unlock_device(loaded)


def evict_all(tree: RadixTree) -> torch.Tensor:
    """Evict the whole device tier (what memory pressure would do), returning the freed indices."""
    return tree.evict_device(10_000).freed_device


def test_a_locked_child_below_keeps_the_failed_pages_poisoned_until_evicted() -> None:
    """Guards against the kept path handing out bad KV: a device-only child below the failed pages,
    locked by a lease, keeps them on the device; before the fix a later match of the key (or of the child)
    returned the failed pages as a device hit and a model read bytes that were no node's KV."""
    tree = RadixTree(P)
    host_only_chain_loaded(tree)
    child = insert_device_child(tree)
    tree.lock_device(child)
    freed, kept = tree.drop_failed_load(KEY, 0, LOADED)
    tree.sanity_check()
    assert freed.freed_device.numel() == 0
    assert len(kept) == 1  # the loaded node
    assert all(tree.node_info(k).device_value is not None for k in kept)
    assert_nothing_reads_the_failed_pages(tree)
    assert_every_index_accounted(tree, freed.freed_device)
    tree.unlock_device(child)
    release_load_locks(tree, kept[-1])
    tree.sanity_check()
    assert_nothing_reads_the_failed_pages(tree)
    gone = evict_all(tree)
    tree.sanity_check()
    assert_every_index_accounted(tree, torch.cat([freed.freed_device, gone]))
    assert tree.device_tokens_owned().numel() == 0
    match = tree.match_prefix(KEY)  # the host copy is a hit again, to load back
    assert (match.device_len, match.host_len) == (0, 16)


def test_a_backup_in_flight_below_keeps_the_failed_pages_poisoned() -> None:
    """Guards against the same through a backup: the device-only child inserted below is being backed up
    (write-through) when the load fails, so it and the loaded chain stay on the device; no match reaches
    them, the backup (of the child's own pages) commits, and after eviction the host copies are hits."""
    tree = RadixTree(P)
    host_only_chain_loaded(tree)
    child = insert_device_child(tree)
    tree.begin_backup(child, ids(2000, 4))
    freed, kept = tree.drop_failed_load(KEY, 0, LOADED)
    tree.sanity_check()
    assert freed.freed_device.numel() == 0
    assert len(kept) == 1
    assert_nothing_reads_the_failed_pages(tree)
    tree.commit_backup(child)
    tree.sanity_check()
    assert_nothing_reads_the_failed_pages(tree)
    release_load_locks(tree, kept[-1])
    gone = evict_all(tree)
    tree.sanity_check()
    assert_every_index_accounted(tree, torch.cat([freed.freed_device, gone]))
    match = tree.match_prefix(CHILD_KEY)
    assert (match.device_len, match.host_len) == (0, 20)  # the child's backup is a host hit below


def test_a_host_only_child_below_keeps_the_failed_pages_poisoned() -> None:
    """Guards against the same through write-back: a device-only node below the failed pages has a
    host-only child (backed up and demoted under write-back), so neither can leave; no match reaches the
    failed pages or anything below them."""
    tree = RadixTree(P, write_policy="write_back")
    host_only_chain_loaded(tree)
    grand_key = CHILD_KEY + page_key(950, 1)
    tree.insert(grand_key, torch.cat([ids(600, 16), CHILD, ids(420, 4)]))
    tree.match_prefix(CHILD_KEY)  # splits the child from the grandchild
    grand = tree.match_prefix(grand_key).last_device_node
    tree.begin_backup(grand, ids(3000, 4))
    tree.commit_backup(grand)
    release_load_locks(tree, tree.match_prefix(KEY).last_device_node)  # only the host child holds
    assert torch.equal(tree.evict_device(4).freed_device, ids(420, 4))
    freed, kept = tree.drop_failed_load(KEY, 0, LOADED)
    tree.sanity_check()
    assert freed.freed_device.numel() == 0
    assert len(kept) == 1
    for key in (KEY, CHILD_KEY, grand_key):
        assert tree.match_prefix(key).device_len == 0
        assert tree.match_prefix(key).host_len == 0
    assert_every_index_accounted(tree, freed.freed_device)


def test_clear_poison_makes_recopied_pages_hits_again() -> None:
    """Once the host copies of the poisoned nodes landed in their pages again, `clear_poison` makes them
    hits (and a split meanwhile does not lose the mark: both halves are cleared)."""
    tree = RadixTree(P)
    host_only_chain_loaded(tree)
    child = insert_device_child(tree)
    tree.lock_device(child)
    _, kept = tree.drop_failed_load(KEY, 0, LOADED)
    recopied = torch.cat([tree.node_info(k).device_value for k in kept])  # what the copy writes
    tree.match_prefix(page_key(0, 1) + page_key(700, 1))  # splits the poisoned node meanwhile
    tree.sanity_check()
    assert tree.match_prefix(CHILD_KEY).device_len == 0
    assert tree.clear_poison(KEY, 0, recopied) == 2
    tree.sanity_check()
    match = tree.match_prefix(CHILD_KEY)
    assert match.device_len == 20
    assert torch.equal(match.device_indices, torch.cat([LOADED, CHILD]))


def test_nothing_loaded_there_frees_nothing() -> None:
    """Pages that are no longer where the load put them (evicted meanwhile) are not the tree's to return."""
    tree = RadixTree(P)
    tree.insert(KEY, ids(0, 16))
    freed, kept = tree.drop_failed_load(KEY, 0, LOADED)
    assert freed.freed_device.numel() == 0
    assert kept == ()
    assert tree.match_prefix(KEY).device_len == 16
    tree.sanity_check()


def test_poison_queries_refuse_bad_arguments() -> None:
    """`clear_poison` names a bad `start`; `poisoned` refuses a handle that is not a live node; neither
    changes anything then."""
    tree = RadixTree(P)
    host_only_chain_loaded(tree)
    child = insert_device_child(tree)
    tree.lock_device(child)
    _, (kept,) = tree.drop_failed_load(KEY, 0, LOADED)
    with pytest.raises(ValueError, match="start"):
        tree.clear_poison(KEY, -1, LOADED)
    with pytest.raises(TypeError, match="node"):
        tree.poisoned("node 1")  # type: ignore[arg-type]
    assert tree.poisoned(kept)
    assert not tree.poisoned(child)
    assert tree.clear_poison(KEY, 0, ids(900, 16)) == 0  # not the pages copied again: stays poisoned
    assert tree.poisoned(kept)
    tree.sanity_check()
