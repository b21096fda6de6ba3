"""The page allocator: whole aligned pages out, validated pages back, nothing changed on error."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.errors import PoolError
from hicache.memory import Owner, PageAllocator

P = 4


def state(alloc: PageAllocator) -> tuple[int, int, int]:
    return (alloc.free_pages, alloc.used_pages, alloc.capacity_pages)


def test_alloc_returns_aligned_page_runs() -> None:
    alloc = PageAllocator(num_pages=8, page_size=P)
    idx = alloc.alloc(3 * P)
    assert idx is not None
    assert idx.dtype == torch.int64
    assert idx.tolist() == list(range(3 * P))
    assert state(alloc) == (5, 3, 8)
    assert alloc.page_ids(idx).tolist() == [0, 1, 2]


def test_alloc_then_free_round_trip_restores_every_page() -> None:
    alloc = PageAllocator(num_pages=6, page_size=P)
    a = alloc.alloc(2 * P)
    b = alloc.alloc(4 * P)
    assert a is not None
    assert b is not None
    assert alloc.free_pages == 0
    alloc.free(a)
    alloc.free(b)
    assert state(alloc) == (6, 0, 6)
    again = alloc.alloc(6 * P)
    assert again is not None
    assert sorted(alloc.page_ids(again).tolist()) == list(range(6))


def test_exhaustion_returns_none_and_allocates_nothing() -> None:
    """Running out is a value: a too-large request takes no pages at all."""
    alloc = PageAllocator(num_pages=3, page_size=P)
    assert alloc.alloc(2 * P) is not None
    assert alloc.alloc(2 * P) is None
    assert state(alloc) == (1, 2, 3)
    assert alloc.alloc(P) is not None
    assert alloc.alloc(P) is None


def test_alloc_zero_tokens_is_empty() -> None:
    alloc = PageAllocator(num_pages=2, page_size=P)
    idx = alloc.alloc(0)
    assert idx is not None
    assert idx.numel() == 0
    alloc.free(idx)
    assert state(alloc) == (2, 0, 2)


@pytest.mark.parametrize("num_tokens", [1, P + 1, -P])
def test_alloc_rejects_partial_pages_and_negative_counts(num_tokens: int) -> None:
    alloc = PageAllocator(num_pages=2, page_size=P)
    with pytest.raises(ValueError, match="num_tokens"):
        alloc.alloc(num_tokens)
    assert state(alloc) == (2, 0, 2)


@pytest.mark.parametrize(("num_pages", "page_size", "field"), [(-1, 4, "num_pages"), (4, 0, "page_size")])
def test_constructor_validates(num_pages: int, page_size: int, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        PageAllocator(num_pages, page_size)


def test_double_free_raises_and_frees_nothing() -> None:
    alloc = PageAllocator(num_pages=4, page_size=P)
    a = alloc.alloc(2 * P)
    b = alloc.alloc(P)
    assert a is not None
    assert b is not None
    alloc.free(a[:P])
    before = state(alloc)
    # b is still allocated but page 0 (a[:P]) is already free: the whole call is rejected.
    with pytest.raises(PoolError, match="double free"):
        alloc.free(torch.cat([b, a[:P]]))
    assert state(alloc) == before
    assert not alloc.is_free(int(alloc.page_ids(b)[0]))


def test_repeated_page_in_one_call_is_a_double_free() -> None:
    alloc = PageAllocator(num_pages=4, page_size=P)
    a = alloc.alloc(P)
    assert a is not None
    with pytest.raises(PoolError, match="double free"):
        alloc.free(torch.cat([a, a]))
    assert state(alloc) == (3, 1, 4)


def test_foreign_indices_raise() -> None:
    alloc = PageAllocator(num_pages=2, page_size=P)
    assert alloc.alloc(P) is not None
    with pytest.raises(PoolError, match="foreign"):
        alloc.free(torch.arange(8 * P, 9 * P, dtype=torch.int64))
    with pytest.raises(PoolError, match="foreign"):
        alloc.free(torch.arange(-P, 0, dtype=torch.int64))
    assert state(alloc) == (1, 1, 2)


@pytest.mark.parametrize(
    "bad",
    [
        torch.arange(1, P + 1, dtype=torch.int64),  # shifted by one token
        torch.arange(0, P - 1, dtype=torch.int64),  # partial page
        torch.tensor([0, 2, 1, 3], dtype=torch.int64),  # right tokens, wrong order
    ],
)
def test_misaligned_indices_raise(bad: torch.Tensor) -> None:
    alloc = PageAllocator(num_pages=2, page_size=P)
    assert alloc.alloc(2 * P) is not None
    with pytest.raises(PoolError, match="indices"):
        alloc.free(bad)
    assert state(alloc) == (0, 2, 2)


def test_indices_are_checked_whatever_their_layout_and_sign() -> None:
    """The one-pass check in C (`page_runs`) reads a strided tensor's values, not its memory, and says
    misaligned for a negative start off a page boundary (floor division: page -1 would not start there),
    foreign for one on it."""
    alloc = PageAllocator(num_pages=2, page_size=P)
    held = alloc.alloc(2 * P)
    assert held is not None
    wide = torch.zeros(2 * P, 2, dtype=torch.int64)
    wide[:, 0] = held
    strided = wide[:, 0]
    assert not strided.is_contiguous()
    assert alloc.page_ids(strided).tolist() == alloc.page_ids(held).tolist()
    with pytest.raises(PoolError, match="page-aligned runs"):
        alloc.free(torch.arange(-P - 1, -1, dtype=torch.int64))
    with pytest.raises(PoolError, match="foreign"):
        alloc.free(torch.arange(-2 * P, -P, dtype=torch.int64))
    assert state(alloc) == (0, 2, 2)
    alloc.free(strided)
    assert state(alloc) == (2, 0, 2)


@pytest.mark.parametrize(
    "bad",
    [
        torch.arange(P, dtype=torch.int32),
        torch.arange(P, dtype=torch.float32),
        torch.arange(P, dtype=torch.int64).view(1, P),
        list(range(P)),
    ],
)
def test_wrong_type_or_dtype_raises_type_error_naming_indices(bad: object) -> None:
    alloc = PageAllocator(num_pages=2, page_size=P)
    assert alloc.alloc(P) is not None
    with pytest.raises(TypeError, match="indices"):
        alloc.free(bad)  # type: ignore[arg-type]
    assert state(alloc) == (1, 1, 2)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 5)), max_size=30))
def test_random_alloc_free_never_hands_out_a_page_twice(ops: list[tuple[bool, int]]) -> None:
    alloc = PageAllocator(num_pages=10, page_size=2)
    held: list[torch.Tensor] = []
    for do_alloc, n in ops:
        if do_alloc or not held:
            got = alloc.alloc(2 * n)
            if got is None:
                assert n > alloc.free_pages
                continue
            held.append(got)
        else:
            alloc.free(held.pop(n % len(held)))
        owned = torch.cat(held) if held else torch.empty(0, dtype=torch.int64)
        pages = alloc.page_ids(owned)
        assert torch.unique(pages).numel() == pages.numel()
        assert alloc.used_pages == pages.numel()
        assert alloc.free_pages + alloc.used_pages == 10


def test_owner_tags_follow_alloc_set_owner_and_free() -> None:
    """Each page carries its holder: the tag `alloc` gave it, a re-tag, then FREE again once freed."""
    alloc = PageAllocator(num_pages=8, page_size=P)
    caller = alloc.alloc(2 * P)
    copy = alloc.alloc(P, Owner.COPY)
    assert caller is not None
    assert copy is not None
    assert [alloc.owner_of(p) for p in range(4)] == [Owner.LEASE, Owner.LEASE, Owner.COPY, Owner.FREE]
    alloc.set_owner(copy, Owner.TREE)
    assert alloc.owner_of(2) is Owner.TREE
    assert alloc.owner_tags().tolist()[:4] == [Owner.LEASE, Owner.LEASE, Owner.TREE, Owner.FREE]
    with pytest.raises(
        PoolError, match=r"^indices: page\(s\) \[2\] are not held by the caller .*held by the tree"
    ):
        alloc.free(copy)  # the tree's page: only the tree frees it
    alloc.free(copy, Owner.TREE)
    assert alloc.is_free(2)
    with pytest.raises(ValueError, match="owner"):
        alloc.alloc(P, Owner.FREE)
    with pytest.raises(ValueError, match="owner"):
        alloc.set_owner(caller, Owner.FREE)


def test_set_owner_retags_every_page_of_scattered_runs_and_no_other() -> None:
    """`set_owner` reads one token per page: pages in any order (a tree node's value after splits and
    evictions), a trailing partial page included, are each re-tagged, and the pages between them not."""
    alloc = PageAllocator(num_pages=8, page_size=P)
    held = alloc.alloc(8 * P)
    assert held is not None
    pages = [6, 1, 4, 3]
    indices = torch.cat([torch.arange(p * P, (p + 1) * P) for p in pages] + [torch.arange(7 * P, 7 * P + 1)])
    alloc.set_owner(indices, Owner.TREE)
    assert [alloc.owner_of(p) for p in range(8)] == [
        Owner.TREE if p in {*pages, 7} else Owner.LEASE for p in range(8)
    ]


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (torch.arange(3 * P, 4 * P), "free"),  # never allocated
        (torch.arange(2 * P, 3 * P), "held by the tree"),
        (torch.cat([torch.arange(0, P), torch.arange(0, P)]), "more than once"),
        (torch.arange(1, P + 1), "page-aligned runs"),
        (torch.arange(-P, 0), "outside"),
        (torch.arange(8 * P, 9 * P), "outside"),
    ],
)
def test_check_owned_refuses_pages_of_another_holder_and_changes_nothing(
    bad: torch.Tensor, message: str
) -> None:
    alloc = PageAllocator(num_pages=8, page_size=P)
    caller = alloc.alloc(2 * P)
    tree = alloc.alloc(P, Owner.TREE)
    assert caller is not None
    assert tree is not None
    before = (alloc.owner_tags().tolist(), state(alloc))
    with pytest.raises(PoolError, match=f"mine: .*{message}"):
        alloc.check_owned(bad, Owner.LEASE, name="mine")
    with pytest.raises(PoolError, match=f"mine: .*{message}"):
        alloc.check_owned(bad.numpy(), Owner.LEASE, name="mine")  # the numpy view takes the same checks
    assert (alloc.owner_tags().tolist(), state(alloc)) == before
    assert alloc.check_owned(caller, Owner.LEASE, name="mine").tolist() == [0, 1]
