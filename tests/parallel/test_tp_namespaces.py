"""Namespaces keep tensor-parallel ranks apart on a shared storage tier: pages of rank 0 never load on
rank 1, and pages of a TP=2 deployment never load under TP=4 (its ranks hold other slices of the heads).

In-process: each cache is one rank's, with its rank and size in the namespace and no group (the keys and
headers, not the agreement, keep the pages apart).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from cache_workers import PAGE, rank_cache, serve

SEQ = list(range(100, 100 + 12 * PAGE))


async def write_as(root: Path, rank: int, size: int) -> None:
    """Rank `rank` of a TP=`size` deployment serves SEQ and writes it through to storage."""
    async with rank_cache(None, str(root), rank=rank, size=size) as (cache, _):
        await serve(cache, rank, "w", SEQ)
        await cache.wait_idle()


async def storage_hit_as(root: Path, rank: int, size: int) -> int:
    """A fresh rank `rank` of TP=`size` serves SEQ: the tokens it got from storage."""
    async with rank_cache(None, str(root), rank=rank, size=size) as (cache, _):
        served = await serve(cache, rank, "r", SEQ)
        cache.sanity_check()
    return int(served["hits"]["storage"])


async def test_rank_0_pages_never_load_on_rank_1(tmp_path: Path) -> None:
    await write_as(tmp_path, 0, 2)
    assert await storage_hit_as(tmp_path, 1, 2) == 0
    assert await storage_hit_as(tmp_path, 0, 2) == 12 * PAGE  # the control: rank 0 itself loads them


async def test_tp2_pages_never_load_under_tp4(tmp_path: Path) -> None:
    await write_as(tmp_path, 0, 2)
    assert await storage_hit_as(tmp_path, 0, 4) == 0


async def test_a_rank_0_page_copied_over_a_rank_1_key_is_refused(tmp_path: Path) -> None:
    """Rank 0's files renamed to the keys rank 1 looks up: the header names rank 0's namespace and key,
    so rank 1 reads them as foreign and loads nothing (its oracle check in `serve` would catch a load)."""
    await write_as(tmp_path / "r0", 0, 2)
    await write_as(tmp_path / "r1", 1, 2)
    r0 = sorted((tmp_path / "r0").rglob("*.kvp"))
    r1 = sorted((tmp_path / "r1").rglob("*.kvp"))
    assert len(r0) == len(r1) == 12
    for dst, src in zip(r1, r0, strict=True):  # every rank-1 page file now holds a rank-0 page
        shutil.copyfile(src, dst)
    assert await storage_hit_as(tmp_path / "r1", 1, 2) == 0
