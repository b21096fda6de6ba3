"""Page-first KV pools: layout, zero-copy page views, token gather/scatter, pinning fallback, statistics."""

from __future__ import annotations

import gc
import logging
import warnings
from collections.abc import Iterator

import pytest
import torch

from hicache.errors import CacheClosed, PoolError
from hicache.memory import HostPool, KVLayout, KVPool, make_device_pool, make_host_pool

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, dtype=torch.float16, page_size=4)


_open_pools: list[KVPool] = []


def opened(pool: KVPool) -> KVPool:
    """Register `pool` to be closed after the test."""
    _open_pools.append(pool)
    return pool


@pytest.fixture(autouse=True)
def close_pools() -> Iterator[None]:
    """Close every pool the test opened: an unclosed pool warns, and warnings are errors."""
    yield
    while _open_pools:
        _open_pools.pop().close()


def make_pool(num_pages: int = 6, layout: KVLayout = LAYOUT) -> KVPool:
    return opened(KVPool(layout, num_pages, device="cpu", pin_memory=False, name="test"))


def random_kv(layout: KVLayout, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layout.tokens_shape(n), generator=g).to(layout.dtype)


# -- layout -------------------------------------------------------------------------------------------


def test_layout_page_shape_and_nbytes() -> None:
    assert LAYOUT.page_shape == (3, 2, 4, 2, 4)
    assert LAYOUT.page_nbytes == 3 * 2 * 4 * 2 * 4 * 2
    assert LAYOUT.token_nbytes * LAYOUT.page_size == LAYOUT.page_nbytes


@pytest.mark.parametrize("field", ["num_layers", "num_kv_heads", "head_dim", "page_size"])
def test_layout_rejects_non_positive_fields(field: str) -> None:
    kwargs: dict[str, object] = {
        "num_layers": 1,
        "num_kv_heads": 1,
        "head_dim": 1,
        "dtype": torch.float32,
        "page_size": 1,
    }
    kwargs[field] = 0
    with pytest.raises(ValueError, match=field):
        KVLayout(**kwargs)  # type: ignore[arg-type]


def test_layout_rejects_non_dtype() -> None:
    with pytest.raises(TypeError, match="dtype"):
        KVLayout(1, 1, 1, "float16", 1)  # type: ignore[arg-type]


def test_flat_layout_stores_opaque_bytes_per_token() -> None:
    flat = KVLayout.flat(nbytes_per_token=10, page_size=8)
    assert flat.page_nbytes == 80
    assert flat.page_shape == (1, 1, 8, 1, 10)
    pool = make_pool(2, flat)
    idx = pool.alloc(8)
    assert idx is not None
    assert len(pool.page_view(0)) == 80
    with pytest.raises(ValueError, match="nbytes_per_token"):
        KVLayout.flat(0, 8)


# -- buffer and page views ----------------------------------------------------------------------------


def test_buffer_is_page_first_and_contiguous_per_page() -> None:
    pool = make_pool()
    assert pool.buffer.shape == (6, *LAYOUT.page_shape)
    assert pool.buffer.is_contiguous()
    assert pool.buffer[1].data_ptr() - pool.buffer[0].data_ptr() == LAYOUT.page_nbytes


def test_page_view_is_zero_copy_and_writable() -> None:
    """Writing a page view writes the pool: storage backends read and fill pages without copies."""
    pool = make_pool()
    view = pool.page_view(2)
    assert not view.readonly
    assert view.nbytes == LAYOUT.page_nbytes
    view[:] = b"\x01" * LAYOUT.page_nbytes
    assert bool((pool.buffer[2].view(torch.uint8) == 1).all())
    assert bool((pool.buffer[1].view(torch.uint8) == 0).all())
    assert bool((pool.buffer[3].view(torch.uint8) == 0).all())
    pool.buffer[2].fill_(0)
    assert bytes(view) == b"\x00" * LAYOUT.page_nbytes


def test_page_view_bytes_match_page_tensor() -> None:
    pool = make_pool()
    idx = pool.alloc(2 * LAYOUT.page_size)
    assert idx is not None
    pool.write_tokens(idx, random_kv(LAYOUT, idx.numel()))
    views = pool.page_views(idx)
    assert len(views) == 2
    for page, view in zip(pool.page_ids(idx).tolist(), views, strict=True):
        assert bytes(view) == pool.buffer[page].contiguous().view(torch.uint8).numpy().tobytes()


def test_page_views_are_built_once_and_keep_their_identity() -> None:
    """Views are built on first access and kept: stray-thread bookkeeping goes by `id` (issue 12)."""
    pool = make_pool()
    idx = pool.alloc(3 * LAYOUT.page_size)
    assert idx is not None
    pool.write_tokens(idx, random_kv(LAYOUT, idx.numel()))
    views = pool.page_views(idx)
    pages = pool.page_ids(idx).tolist()
    batch = views[1:3]
    assert isinstance(batch, list)
    assert len(batch) == 2
    backwards = views[::-1]  # a slice of built and unbuilt views builds the rest, keeps the built ones
    assert backwards[1] is batch[0]
    assert backwards[0] is batch[1]
    assert [id(v) for v in views[0:3:2]] == [id(backwards[2]), id(batch[1])]
    assert batch[0] is views[1]
    assert batch[1] is views[-1]
    assert [id(v) for v in views] == [id(v) for v in views[:]]
    assert views[0] is next(iter(views))
    for page, view in zip(pages, views, strict=True):
        assert bytes(view) == pool.buffer[page].contiguous().view(torch.uint8).numpy().tobytes()
    views[2][0] = (views[2][0] + 1) % 256  # a view writes the pool
    assert pool.byte_view()[pages[2] * LAYOUT.page_nbytes] == views[2][0]
    with pytest.raises(IndexError, match="index"):
        views[3]
    with pytest.raises(IndexError, match="index"):
        views[-4]


def test_page_view_keeps_memory_alive_after_close() -> None:
    pool = make_pool()
    view = pool.page_view(0)
    pool.close()
    view[0] = 7
    assert view[0] == 7


def test_page_view_validates_page_id() -> None:
    pool = make_pool()
    with pytest.raises(ValueError, match="page_id"):
        pool.page_view(6)
    with pytest.raises(TypeError, match="page_id"):
        pool.page_view(1.0)  # type: ignore[arg-type]


def test_page_views_validate_indices() -> None:
    pool = make_pool()
    with pytest.raises(PoolError, match="indices"):
        pool.page_views(torch.arange(1, 5, dtype=torch.int64))


# -- token gather / scatter ---------------------------------------------------------------------------


def test_write_then_read_tokens_round_trip() -> None:
    pool = make_pool()
    idx = pool.alloc(3 * LAYOUT.page_size)
    assert idx is not None
    kv = random_kv(LAYOUT, idx.numel())
    pool.write_tokens(idx, kv)
    assert torch.equal(pool.read_tokens(idx), kv)
    # Any subset of tokens, in any order, reads back the matching slice.
    sub = torch.tensor([5, 0, 11], dtype=torch.int64)
    assert torch.equal(pool.read_tokens(idx[sub]), kv[:, :, sub])


def test_write_tokens_lands_in_the_right_page_slot() -> None:
    pool = make_pool()
    kv = random_kv(LAYOUT, 1)
    token = 2 * LAYOUT.page_size + 3  # page 2, offset 3
    pool.write_tokens(torch.tensor([token]), kv)
    assert torch.equal(pool.buffer[2, :, :, 3], kv[:, :, 0])


def test_write_tokens_checks_shape_and_dtype() -> None:
    pool = make_pool()
    idx = torch.arange(4, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"kv: expected shape \(3, 2, 4, 2, 4\)"):
        pool.write_tokens(idx, random_kv(LAYOUT, 3))
    with pytest.raises(TypeError, match="kv: expected dtype"):
        pool.write_tokens(idx, random_kv(LAYOUT, 4).float())
    with pytest.raises(ValueError, match="indices"):
        pool.read_tokens(torch.tensor([6 * 4], dtype=torch.int64))
    with pytest.raises(TypeError, match="indices"):
        pool.read_tokens(torch.tensor([0], dtype=torch.int32))


# -- allocation and statistics ------------------------------------------------------------------------


def test_pool_errors_leave_statistics_unchanged() -> None:
    pool = make_pool()
    idx = pool.alloc(2 * LAYOUT.page_size)
    assert idx is not None
    pool.free(idx[: LAYOUT.page_size])
    before = pool.statistics()
    bad_calls: list[tuple[type[Exception], object]] = [
        (PoolError, idx),  # first page is already free: double free
        (PoolError, torch.arange(100, 104, dtype=torch.int64)),  # foreign
        (PoolError, idx[1:]),  # misaligned
        (TypeError, idx.to(torch.int32)),  # wrong dtype
    ]
    for exc_type, bad in bad_calls:
        with pytest.raises(exc_type, match="indices"):
            pool.free(bad)  # type: ignore[arg-type]
        assert pool.statistics() == before


def test_statistics_and_repr() -> None:
    pool = make_pool()
    assert pool.alloc(5 * LAYOUT.page_size) is not None
    assert pool.alloc(2 * LAYOUT.page_size) is None
    stats = pool.statistics()
    assert stats.name == "test"
    assert stats.device == "cpu"
    assert (stats.capacity_pages, stats.free_pages, stats.used_pages) == (6, 1, 5)
    assert (stats.page_size, stats.page_nbytes, stats.pinned) == (4, LAYOUT.page_nbytes, False)
    text = repr(pool)
    assert "'test'" in text
    assert "pages=5/6" in text
    assert "pinned=False" in text


async def test_closed_pool_refuses_work() -> None:
    async with make_pool() as pool:
        assert not pool.closed
    assert pool.closed
    await pool.aclose()  # idempotent
    assert "closed" in repr(pool)
    with pytest.raises(CacheClosed):
        pool.alloc(4)
    with pytest.raises(CacheClosed):
        _ = pool.buffer


def test_pool_is_a_context_manager() -> None:
    with KVPool(LAYOUT, 1, pin_memory=False, name="scoped") as pool:
        assert not pool.closed
    assert pool.closed


def test_unclosed_pool_warns_naming_it() -> None:
    """A pool dropped while open warns `ResourceWarning` with its name; a closed one does not."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        KVPool(LAYOUT, 1, pin_memory=False, name="closed-one").close()
        KVPool(LAYOUT, 1, pin_memory=False, name="forgotten")
        gc.collect()
    messages = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert len(messages) == 1
    assert "unclosed <KVPool 'forgotten'" in messages[0]


def test_pool_whose_constructor_failed_does_not_warn() -> None:
    """A half-built pool holds no buffer: its `__del__` stays silent."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match="num_pages"):
            KVPool(LAYOUT, -1, pin_memory=False, name="broken")
        with pytest.raises(TypeError, match="layout"):
            KVPool("layout", 1)  # type: ignore[arg-type]
        gc.collect()
    assert [w for w in caught if issubclass(w.category, ResourceWarning)] == []


# -- pinning ------------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback without an accelerator")
def test_pinning_falls_back_to_pageable_memory_without_cuda(caplog: pytest.LogCaptureFixture) -> None:
    auto = opened(make_host_pool(LAYOUT, 2))
    assert auto.pinned is False
    assert auto.statistics().pinned is False
    assert HostPool is KVPool
    with caplog.at_level(logging.WARNING, logger="hicache.memory.pool"):
        asked = opened(KVPool(LAYOUT, 2, pin_memory=True, name="asked"))
    assert asked.pinned is False
    assert not asked.buffer.is_pinned()
    assert any("pinned memory unavailable" in r.getMessage() for r in caplog.records)
    device = opened(make_device_pool(LAYOUT, 2))
    assert device.device.type == "cpu"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_pool_is_pinned_with_cuda() -> None:
    host = opened(make_host_pool(LAYOUT, 2))
    assert host.pinned
    assert host.buffer.is_pinned()
    device = opened(make_device_pool(LAYOUT, 2))
    assert device.device.type == "cuda"
    with pytest.raises(ValueError, match="pin_memory"):
        KVPool(LAYOUT, 2, device="cuda", pin_memory=True)
    idx = device.alloc(4)
    assert idx is not None
    kv = random_kv(LAYOUT, 4)
    device.write_tokens(idx, kv)
    assert torch.equal(device.read_tokens(idx).cpu(), kv)
