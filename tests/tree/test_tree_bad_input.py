"""Misuse raises `ValueError`/`TypeError` naming the argument, and leaves the tree unchanged."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from hicache.tree import RadixTree

P = 4


def populated_tree() -> RadixTree:
    """A tree with a backed-up prefix and a device-only child."""
    tree = RadixTree(P)
    parent = tree.insert(list(range(8)), torch.arange(8)).node
    tree.begin_backup(parent, torch.arange(100, 108))
    tree.commit_backup(parent)
    tree.insert(list(range(12)), torch.arange(20, 32))
    tree.sanity_check()
    return tree


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"page_size": 0}, ValueError, "page_size"),
        ({"page_size": -3}, ValueError, "page_size"),
        ({"page_size": 2.0}, TypeError, "page_size"),
        ({"page_size": 4, "write_policy": "write_around"}, ValueError, "write_policy"),
        ({"page_size": 4, "eviction_policy": "fifo"}, ValueError, "eviction_policy"),
        ({"page_size": 4, "write_through_threshold": 0}, ValueError, "write_through_threshold"),
        ({"page_size": 4, "namespace": "model"}, TypeError, "namespace"),
    ],
)
def test_constructor_rejects_bad_arguments_by_name(
    kwargs: dict[str, object], error: type[Exception], name: str
) -> None:
    """A misconfigured tree must fail at construction, saying which argument is wrong."""
    with pytest.raises(error, match=name):
        RadixTree(**kwargs)  # type: ignore[arg-type]


BAD_CALLS: list[tuple[str, Callable[[RadixTree], object], type[Exception], str]] = [
    ("float indices", lambda t: t.insert(list(range(4)), torch.zeros(4)), TypeError, "device_indices"),
    (
        "int32 indices",
        lambda t: t.insert(list(range(4)), torch.arange(4, dtype=torch.int32)),
        TypeError,
        "device_indices",
    ),
    ("list indices", lambda t: t.insert(list(range(4)), [0, 1, 2, 3]), TypeError, "device_indices"),  # type: ignore[arg-type]
    (
        "2-D indices",
        lambda t: t.insert(list(range(4)), torch.arange(4).view(2, 2)),
        ValueError,
        "device_indices",
    ),
    (
        "short indices",
        lambda t: t.insert(list(range(100, 106)), torch.arange(5)),
        ValueError,
        "device_indices",
    ),
    ("float key", lambda t: t.insert(torch.zeros(4), torch.arange(4)), TypeError, "key"),
    ("str key", lambda t: t.match_prefix("abcd"), TypeError, "key"),  # type: ignore[arg-type]
    ("negative eviction", lambda t: t.evict_device(-1), ValueError, "num_tokens"),
    ("negative host room", lambda t: t.evict_device(4, -1), ValueError, "host_free_tokens"),
    ("negative host eviction", lambda t: t.evict_host(-4), ValueError, "num_tokens"),
    (
        "host indices length",
        lambda t: t.insert_host(t.root, list(range(50, 58)), torch.arange(3)),
        ValueError,
        "host_indices",
    ),
    (
        "host indices off the CPU",
        lambda t: t.insert_host(t.root, list(range(50, 58)), torch.arange(8, device="meta")),
        ValueError,
        "host_indices",
    ),
    (
        "foreign anchor",
        lambda t: t.insert_host(RadixTree(P).insert([1] * 4, torch.arange(4)).node, [2] * 4, torch.arange(4)),
        ValueError,
        "anchor",
    ),
    (
        "priority type",
        lambda t: t.set_priority(t.node_info(t.root).children[0], 1.5),
        TypeError,
        "priority",
    ),  # type: ignore[arg-type]
    (
        "unlock unlocked",
        lambda t: t.unlock_device(t.node_info(t.root).children[0]),
        ValueError,
        "not device-locked",
    ),
    ("demote root", lambda t: t.demote(t.root), ValueError, "root"),
    ("tuple as a handle", lambda t: t.lock_device((t.root.tree, t.root.id)), TypeError, "NodeRef"),  # type: ignore[arg-type]
    (
        "handle of another tree",
        lambda t: t.lock_device(RadixTree(P).insert([1] * 4, torch.arange(4)).node),
        ValueError,
        "not a live node of this tree",
    ),
]


@pytest.mark.parametrize(("label", "call", "error", "name"), BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_calls_raise_naming_the_argument_and_change_nothing(
    label: str, call: Callable[[RadixTree], object], error: type[Exception], name: str
) -> None:
    """A rejected call must not have half-applied: statistics and invariants are as before."""
    tree = populated_tree()
    before = tree.statistics()
    clock = tree._clock
    with pytest.raises(error, match=name):
        call(tree)
    assert tree.statistics() == before
    assert tree._clock == clock
    tree.sanity_check()
