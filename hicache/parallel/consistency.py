"""Cross-rank checks: the ranks' trees are identical, provably (`check_same_tree`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import xxhash

from hicache.parallel.errors import TreeDivergence
from hicache.parallel.group import RankGroup
from hicache.tree.fingerprint import describe_difference, encode_records, fingerprint_of, node_records
from hicache.tree.radix import RadixTree
from storage_backends.cancellation import run_in_thread

if TYPE_CHECKING:
    from hicache.config import HiCacheConfig

__all__ = ["check_same_pools", "check_same_tree", "check_same_tree_async"]


def check_same_tree(group: RankGroup, tree: RadixTree) -> int:
    """Compare this rank's tree fingerprint with every other rank's; return the fingerprint.

    A collective: every rank calls it at the same point of its program, between agreement steps. One
    collective (the fingerprints, a fixed shape) when the trees agree; when they differ, every rank sees
    it in the gathered fingerprints and two more collectives exchange the node lists, so every rank
    raises the same error naming the first differing node.

    Raises:
        TreeDivergence: the trees differ; the message names the first differing node and the ranks.
        RankFailed: a peer died or stopped responding.
    """
    records = node_records(tree)
    digest = fingerprint_of(records)
    if _same(_gather_digests(group, digest)):
        return digest
    shared = group.gather_bytes(encode_records(records))
    raise TreeDivergence(describe_difference(shared, this_rank=group.tp_rank))


async def check_same_tree_async(group: RankGroup, tree: RadixTree) -> int:
    """`check_same_tree` without blocking the event loop: the tree is read on the loop (a snapshot of its
    node records, taken at the call), the collectives run in a worker thread, each bounded by the group's
    timeout (the thread is waited for, so a cancelled caller still leaves the group consistent).

    Raises:
        TreeDivergence, RankFailed: as `check_same_tree`.
    """
    records = node_records(tree)
    digest = fingerprint_of(records)
    if _same(await run_in_thread(_gather_digests, group, digest)):
        return digest
    shared = await run_in_thread(group.gather_bytes, encode_records(records))
    raise TreeDivergence(describe_difference(shared, this_rank=group.tp_rank))


def _gather_digests(group: RankGroup, digest: int) -> list[int]:
    digests: list[int] = group.gather(torch.tensor([digest], dtype=torch.int64)).view(-1).tolist()
    return digests


def _same(digests: list[int]) -> bool:
    return all(d == digests[0] for d in digests)


def check_same_pools(config: HiCacheConfig) -> None:
    """Refuse ranks whose pages differ in size (`page_size`), or whose hybrid components differ in kind,
    window or page size: the trees are page-granular and a component decides where a prefix may end, so
    such ranks could not hold identical trees. Pool sizes may differ: every decision that depends on
    a rank's pools is agreed (the most any rank must evict, the least room any rank has). One collective
    on `config.tp_group`.

    Raises:
        ValueError: naming `tp_group` and every rank's page size, or this rank's components.
    """
    group = config.tp_group
    assert group is not None
    kinds = _component_kinds(config)
    digest = xxhash.xxh3_64_intdigest(repr(kinds).encode()) & ((1 << 62) - 1)
    rows = group.gather(torch.tensor([config.page_size, digest], dtype=torch.int64)).tolist()
    every = [row[0] for row in rows]
    if any(size != every[0] for size in every):
        raise ValueError(
            f"tp_group: every rank needs the same page_size (the ranks' trees are page-granular); "
            f"page size by rank: {every}"
        )
    if any(row[1] != rows[0][1] for row in rows):
        raise ValueError(
            f"tp_group: every rank needs the same hybrid components (kind, name, window, page size: a "
            f"component decides where a prefix may end); this rank has {kinds}"
        )


def _component_kinds(config: HiCacheConfig) -> list[tuple[object, ...]]:
    """What of each component shapes the tree (pool sizes may differ between ranks)."""
    return [
        (
            type(c).__name__,
            c.name,
            c.rank,
            c.lock_path,
            getattr(c, "window", None),
            c.pool_layout(config.page_size).page_size,
        )
        for c in config.components
    ]
