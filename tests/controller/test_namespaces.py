"""Cross-namespace sharing at the cache level: two caches on one storage root share pages exactly when their
effective namespaces are equal.

Cache A serves a request and writes it through to a file root; a fresh cache B on the same root asks for the
same tokens. B differing from A in any namespace field (layout dims, dtype, page size, model id, TP rank or
size, a component's layout) loads 0 tokens from storage; B configured like A loads every token, bitwise. A
page copied or symlinked over B's own keys (what a hash collision or a careless operator would do) is a miss
counted as `foreign_page`, for full-attention pages and component pages alike.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from page_damage import group_file, page_bytes, pages_at

from hicache import HiCache, HiCacheConfig, KVLayout, MambaState, Namespace, SlidingWindow
from hicache.components import component_storage_key
from hicache.keys import ROOT_HASH, as_key_bytes, chained_page_hashes
from hicache.metrics import render
from storage_backends.file import FileBackend
from storage_backends.page_format import key_digest

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float16, page_size=4)
SEQ = list(range(5000, 5032))
SWA = SlidingWindow(8, KVLayout.flat(8, 4), device_pages=8, host_pages=8)
MAMBA = MambaState(16, device_slots=4, host_slots=4)


@pytest.fixture(autouse=True)
def _quiet_expected_warnings(caplog: pytest.LogCaptureFixture) -> None:
    """Refused pages are logged at warning level; that is expected here."""
    caplog.set_level(logging.ERROR, logger="storage_backends")
    caplog.set_level(logging.ERROR, logger="hicache")


def config(root: Path, **overrides: object) -> HiCacheConfig:
    options: dict[str, object] = {
        "layout": LAYOUT,
        "device_pages": 32,
        "host_pages": 32,
        "storage_url": f"file://{root}",
        "namespace": Namespace(model_id="model@rev1"),
        "prefetch_threshold": 4,
        "prefetch_stop_policy": "wait_complete",
    }
    options.update(overrides)
    return HiCacheConfig(**options)  # type: ignore[arg-type]


def layout(**fields: object) -> KVLayout:
    return dataclasses.replace(LAYOUT, **fields)  # type: ignore[arg-type]


PAIRS: dict[str, tuple[dict[str, object], dict[str, object]]] = {
    "num_layers": ({}, {"layout": layout(num_layers=4)}),
    "heads_and_dim_same_bytes": ({}, {"layout": layout(num_kv_heads=1, head_dim=16)}),
    "head_dim": ({}, {"layout": layout(head_dim=16)}),
    "dtype_same_bytes": ({}, {"layout": layout(dtype=torch.bfloat16)}),
    "dtype": ({}, {"layout": layout(dtype=torch.float32)}),
    "page_size": ({}, {"layout": layout(page_size=8)}),
    "model_id": ({}, {"namespace": Namespace(model_id="model@rev2")}),
    "tp_rank": (
        {"namespace": Namespace(model_id="model@rev1", tp_rank=0, tp_size=2)},
        {"namespace": Namespace(model_id="model@rev1", tp_rank=1, tp_size=2)},
    ),
    "tp_size": ({}, {"namespace": Namespace(model_id="model@rev1", tp_rank=0, tp_size=2)}),
    "swa_layout": (
        {"components": (SWA,)},
        {"components": (dataclasses.replace(SWA, layout=KVLayout.flat(16, 4)),)},
    ),
    "mamba_state": (
        {"components": (MAMBA,)},
        {"components": (dataclasses.replace(MAMBA, state_nbytes=32),)},
    ),
}
"""Configurations A and B (overrides of `config`) that differ in one namespace field each."""


def kv_for(layout_: KVLayout, n: int, seed: int) -> torch.Tensor:
    """Distinct KV for `n` tokens, in `layout_`'s shape and dtype."""
    gen = torch.Generator().manual_seed(seed)
    shape = layout_.tokens_shape(n)
    if layout_.dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    return torch.rand(shape, generator=gen).to(layout_.dtype)


async def serve(cache: HiCache, seq: list[int]) -> dict[str, torch.Tensor]:
    """Serve `seq` with fresh KV (and component values); return what the cache holds for it, by pool."""
    lease = await cache.acquire("serve", seq)
    assert lease.cached_len == 0
    n = len(seq)
    new = await cache.alloc_device(n)
    assert new is not None
    cache.device_pool.write_tokens(new, kv_for(cache.config.layout, n, seed=1))
    components: dict[str, torch.Tensor] = {}
    written = {"kv": cache.device_pool.read_tokens(new)}
    for comp in cache.components:
        pool = cache.component_pool(comp.name)
        slots = SWA.window if isinstance(comp, SlidingWindow) else 1
        indices = cache.alloc_component(comp.name, slots)
        assert indices is not None
        pool.write_tokens(indices, kv_for(pool.layout, slots, seed=2))
        written[comp.name] = pool.read_tokens(indices)
        components[comp.name] = indices
    await cache.insert(lease, seq, new, components or None)
    await cache.wait_idle()
    return written


def storage_failures(cache: HiCache) -> dict[str, float]:
    text = render(cache.registry)
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(r'^hicache_storage_page_failures_total\{reason="([a-z_]+)"\} (\S+)$', text, re.M)
    }


async def acquire_from_storage(cache: HiCache, seq: list[int]) -> tuple[int, dict[str, torch.Tensor]]:
    """Acquire `seq` in a fresh cache: the storage tokens and what its device pools then hold."""
    lease = await cache.acquire("again", seq)
    try:
        held = {"kv": cache.device_pool.read_tokens(lease.device_indices)}
        for name, indices in lease.component_indices.items():
            held[name] = cache.component_pool(name).read_tokens(indices)
        return lease.hit_tokens_by_tier["storage"], held
    finally:
        cache.release(lease)
        await cache.wait_idle()
        cache.sanity_check()


@pytest.mark.parametrize("field", list(PAIRS))
async def test_caches_share_pages_exactly_when_their_namespaces_match(tmp_path: Path, field: str) -> None:
    """B differing from A in `field` loads 0 of A's tokens from the shared root; A' configured like A loads
    all of them, bitwise (and so does A from B's pages, the other way round)."""
    a_overrides, b_overrides = PAIRS[field]
    a_config, b_config = config(tmp_path, **a_overrides), config(tmp_path, **b_overrides)
    assert a_config.namespace != b_config.namespace
    async with HiCache(a_config) as a:
        a_written = await serve(a, SEQ)
    async with HiCache(b_config) as b:
        storage_tokens, _ = await acquire_from_storage(b, SEQ)
        assert storage_tokens == 0
        assert storage_failures(b) == {}  # different keys: nothing found, nothing refused
        b_written = await serve(b, SEQ)
    for cfg, written in ((a_config, a_written), (b_config, b_written)):
        async with HiCache(cfg) as again:
            storage_tokens, held = await acquire_from_storage(again, SEQ)
            assert storage_tokens == len(SEQ)
            assert held.keys() == written.keys()
            for name, values in written.items():
                assert torch.equal(held[name], values), name
            assert storage_failures(again) == {}


async def page_paths(
    root: Path, cfg: HiCacheConfig, seq: list[int], component: str | None = None
) -> list[Path]:
    """The files of `seq`'s pages (of `component`, else full-attention) under `cfg`'s keys."""
    hashes = chained_page_hashes(as_key_bytes(seq), cfg.page_size, cfg.namespace, ROOT_HASH)
    keys = [h.hex() if component is None else component_storage_key(h, component) for h in hashes]
    async with FileBackend(root, namespace_digest=cfg.namespace.digest) as backend:
        return [backend.path_of(k) for k in keys]


@pytest.mark.parametrize("how", ["copy", "symlink"])
async def test_pages_planted_under_another_caches_keys_load_nothing(tmp_path: Path, how: str) -> None:
    """A's valid pages copied or symlinked over B's keys (B: another model id, the same layout) are found
    by B's lookup, refused by their headers, counted as foreign pages, and never loaded."""
    a_config = config(tmp_path)
    b_config = config(tmp_path, namespace=Namespace(model_id="model@rev2"))
    async with HiCache(a_config) as a:
        await serve(a, SEQ)
    a_paths = await page_paths(tmp_path, a_config, SEQ)
    b_paths = await page_paths(tmp_path, b_config, SEQ)
    for src, dst in zip(a_paths, b_paths, strict=True):
        dst.parent.mkdir(parents=True, exist_ok=True)
        if how == "copy":
            shutil.copyfile(src, dst)
        else:
            os.symlink(src, dst)
    async with HiCache(b_config) as b:
        storage_tokens, held = await acquire_from_storage(b, SEQ)
        assert storage_tokens == 0
        assert held["kv"].numel() == 0
        assert storage_failures(b) == {"foreign_page": 1.0}  # the stream stops at the first refused page


async def test_a_component_page_copied_over_another_key_is_refused(tmp_path: Path) -> None:
    """Component pages are bound to their keys too: A's window page copied over the key of another
    window page of the same request makes the prefetch incomplete, counted as a foreign page; the request
    loads nothing from storage, and the copy never reaches a device pool."""
    cfg = config(tmp_path, components=(SWA,))
    async with HiCache(cfg) as a:
        await serve(a, SEQ)
    *_, before, last = await page_paths(tmp_path, cfg, SEQ, SWA.name)
    assert before.exists()
    assert last.exists()
    # `before`'s page bytes under `last`'s name, in a group file of their own (a page copied over another
    # key: the two share one group file as written, `page_damage`)
    stored = pages_at(tmp_path, cfg.namespace.digest)
    before_key = before.name.removesuffix(".kvp")
    copied = page_bytes(stored, before_key)
    last.unlink()
    last.write_bytes(group_file([(key_digest(before_key), copied)]))
    async with HiCache(cfg) as again:
        storage_tokens, _ = await acquire_from_storage(again, SEQ)
        assert storage_tokens == 0
        assert storage_failures(again) == {"foreign_page": 1.0}
        assert not last.exists()  # removed: the next write-through of this path puts the real page back
        written = await serve(again, SEQ)
    async with HiCache(cfg) as healed:
        storage_tokens, held = await acquire_from_storage(healed, SEQ)
        assert storage_tokens == len(SEQ)
        assert torch.equal(held[SWA.name], written[SWA.name])


async def test_refused_pages_are_removed_so_the_write_through_puts_the_real_ones_back(tmp_path: Path) -> None:
    """A page refused as foreign under one of this namespace's keys can never load for anyone: the read
    removes it, and when the cache then computes the request and writes it through, its own pages take
    those keys again; a fresh cache loads every token, with no failure counted."""
    a_config = config(tmp_path)
    b_config = config(tmp_path, namespace=Namespace(model_id="model@rev2"))
    async with HiCache(a_config) as a:
        await serve(a, SEQ)
    a_paths = await page_paths(tmp_path, a_config, SEQ)
    b_paths = await page_paths(tmp_path, b_config, SEQ)
    for src, dst in zip(a_paths, b_paths, strict=True):
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
    assert a_config.namespace != b_config.namespace
    async with HiCache(b_config) as b:
        storage_tokens, _ = await acquire_from_storage(b, SEQ)
        assert storage_tokens == 0
        assert storage_failures(b) == {"foreign_page": 1.0}
        assert not any(p.exists() for p in b_paths)  # one batch read them all; each was refused and removed
        written = await serve(b, SEQ)
    assert all(p.exists() for p in b_paths)
    async with HiCache(b_config) as again:
        storage_tokens, held = await acquire_from_storage(again, SEQ)
        assert storage_tokens == len(SEQ)
        assert torch.equal(held["kv"], written["kv"])
        assert storage_failures(again) == {}
