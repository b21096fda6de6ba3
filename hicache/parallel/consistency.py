"""Cross-rank checks: the ranks' trees are identical, provably (`check_same_tree`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hicache.parallel.errors import TreeDivergence
from hicache.parallel.group import RankGroup
from hicache.tree.fingerprint import describe_difference, encode_records, fingerprint, node_records
from hicache.tree.radix import RadixTree

if TYPE_CHECKING:
    from hicache.config import HiCacheConfig

__all__ = ["check_same_pools", "check_same_tree"]


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
    digest = fingerprint(tree)
    gathered = group.gather(torch.tensor([digest], dtype=torch.int64)).view(-1).tolist()
    if all(d == gathered[0] for d in gathered):
        return digest
    shared = group.gather_bytes(encode_records(node_records(tree)))
    raise TreeDivergence(describe_difference(shared, this_rank=group.tp_rank))


def check_same_pools(config: HiCacheConfig) -> None:
    """Refuse ranks whose pages differ in size (`page_size`): the trees are page-granular, so ranks with
    different pages could not hold identical trees. Pool sizes may differ: every decision that depends on
    a rank's pools is agreed (the most any rank must evict, the least room any rank has). One collective
    on `config.tp_group`.

    Raises:
        ValueError: naming `tp_group` and every rank's page size.
    """
    group = config.tp_group
    assert group is not None
    every = group.gather(torch.tensor([config.page_size], dtype=torch.int64)).view(-1).tolist()
    if any(size != every[0] for size in every):
        raise ValueError(
            f"tp_group: every rank needs the same page_size (the ranks' trees are page-granular); "
            f"page size by rank: {every}"
        )
