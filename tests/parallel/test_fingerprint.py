"""The tree fingerprint: equal for trees built by the same operations in any order, different when the
structure, a tier, a backed-up flag or a lock differs; the message names the first differing node."""

from __future__ import annotations

import pytest
from tree_helpers import build_tree

from hicache.tree.fingerprint import describe_difference, encode_records, fingerprint, node_records


def test_the_same_operations_in_another_order_give_the_same_fingerprint() -> None:
    """Children are ordered by their tokens, not by dict insertion: rank-local order does not matter."""
    assert fingerprint(build_tree()) == fingerprint(build_tree(reverse=True))
    assert [r.compared() for r in node_records(build_tree())] == [
        r.compared() for r in node_records(build_tree(reverse=True))
    ]


@pytest.mark.parametrize("difference", ["lock", "host", "extra"])
def test_a_lock_a_backup_or_a_node_changes_the_fingerprint(difference: str) -> None:
    assert fingerprint(build_tree(difference)) != fingerprint(build_tree())


def test_the_difference_names_the_first_differing_node() -> None:
    """One rank backed up the third prompt's node: the message shows that node on both ranks."""
    shared = [encode_records(node_records(build_tree())), encode_records(node_records(build_tree("host")))]
    message = describe_difference(shared, this_rank=1)
    assert "rank 1: the ranks' trees differ at node #3 in canonical order" in message
    assert "rank 0 has node 4 tokens [0, 4) starting [9, 10, 11, 12] tiers=device " in message
    assert "rank 1 has node 4 tokens [0, 4) starting [9, 10, 11, 12] tiers=device+host " in message


def test_a_node_missing_on_one_rank_is_named() -> None:
    shared = [encode_records(node_records(build_tree())), encode_records(node_records(build_tree("extra")))]
    message = describe_difference(shared)
    assert "rank 0 has no node there" in message
    assert "starting [13, 14]" in message


def test_records_hold_no_rank_local_value() -> None:
    """Two trees with different pool indices and namespaces still fingerprint alike."""
    from tree_helpers import indices

    from hicache.keys import Namespace
    from hicache.tree import RadixTree

    a = RadixTree(page_size=2, namespace=Namespace(tp_rank=0, tp_size=2))
    b = RadixTree(page_size=2, namespace=Namespace(tp_rank=1, tp_size=2))
    a.insert([1, 2, 3, 4], indices(0, 4))
    b.insert([1, 2, 3, 4], indices(40, 4))
    assert fingerprint(a) == fingerprint(b)
