"""`drop_failed_load`: the pages of a load-back whose copy failed leave the device tier whatever locks them,
with the device subtree below them (device prefix continuity), and come back once to be freed; a
device-only node that a holder keeps below them keeps them too, and is reported."""

from __future__ import annotations

import torch

from hicache.tree import RadixTree

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


def test_a_device_child_inserted_below_goes_too_unless_a_holder_keeps_it() -> None:
    """A device-only child inserted below the loaded pages must leave with them: unlocked, it leaves
    the tree and its pages come back too; locked by a lease, it keeps its ancestors (reported as kept)."""
    for locked in (False, True):
        tree = RadixTree(P)
        host_only_chain_loaded(tree)
        child = tree.insert(KEY + page_key(900, 1), torch.cat([LOADED, ids(400, 4)])).node
        if locked:
            tree.lock_device(child)
        freed, kept = tree.drop_failed_load(KEY, 0, LOADED)
        tree.sanity_check()
        if locked:
            assert freed.freed_device.numel() == 0
            assert len(kept) == 1
            assert tree.match_prefix(KEY + page_key(900, 1)).device_len == 20
        else:
            assert kept == ()
            assert torch.equal(torch.sort(freed.freed_device).values, torch.cat([LOADED, ids(400, 4)]))
            assert not tree.is_live(child)
            assert tree.match_prefix(KEY).device_len == 0


def test_nothing_loaded_there_frees_nothing() -> None:
    """Pages that are no longer where the load put them (evicted meanwhile) are not the tree's to return."""
    tree = RadixTree(P)
    tree.insert(KEY, ids(0, 16))
    freed, kept = tree.drop_failed_load(KEY, 0, LOADED)
    assert freed.freed_device.numel() == 0
    assert kept == ()
    assert tree.match_prefix(KEY).device_len == 16
    tree.sanity_check()
