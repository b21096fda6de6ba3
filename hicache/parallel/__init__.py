"""Tensor parallelism: the ranks of a TP group run one cache each over their slices of the KV heads, and
agree every decision that depends on rank-local facts before their trees change (one collective per
agreement step, of a fixed shape), so the trees stay identical (`check_same_tree`)."""

from __future__ import annotations

from hicache.parallel.agreement import (
    AGREEMENT_CAPACITY,
    Agreement,
    AgreementStatistics,
    Decision,
    StepResult,
)
from hicache.parallel.consistency import check_same_pools, check_same_tree, check_same_tree_async
from hicache.parallel.errors import RankDivergence, RankFailed, RankGroupError, TreeDivergence
from hicache.parallel.group import RankGroup
from hicache.parallel.layer_readiness import AgreedLayerReadiness

__all__ = [
    "AGREEMENT_CAPACITY",
    "AgreedLayerReadiness",
    "Agreement",
    "AgreementStatistics",
    "Decision",
    "RankDivergence",
    "RankFailed",
    "RankGroup",
    "RankGroupError",
    "StepResult",
    "TreeDivergence",
    "check_same_pools",
    "check_same_tree",
    "check_same_tree_async",
]
