"""Argument checks and index joins shared by the tree's modules."""

from __future__ import annotations

import torch

from hicache.components.base import TIERS
from hicache.tree.node import join_indices
from hicache.tree.results import EMPTY_INDICES

__all__ = ["cat_indices", "check_count", "check_indices", "check_tier"]


def check_indices(value: object, name: str, expected: int) -> torch.Tensor:
    """Validate a 1-D int64 tensor of `expected` entries; raise naming `name` otherwise."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a 1-D int64 tensor, got {type(value).__name__}")
    if value.dtype != torch.int64:
        raise TypeError(f"{name}: expected dtype torch.int64, got {value.dtype}")
    if value.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D tensor, got shape {tuple(value.shape)}")
    if value.shape[0] != expected:
        raise ValueError(f"{name}: expected {expected} entries (one per token), got {value.shape[0]}")
    return value


def cat_indices(parts: list[torch.Tensor]) -> torch.Tensor:
    """Join index tensors (the shared empty tensor for none, the one part itself for one)."""
    if not parts:
        return EMPTY_INDICES
    if len(parts) == 1:
        return parts[0]
    return join_indices(parts)


def check_count(value: object, name: str) -> int:
    """Validate a non-negative int count; raise naming `name` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name}: must be >= 0, got {value}")
    return value


def check_tier(tier: object) -> str:
    """Validate a tier name (`"device"` or `"host"`); raise `ValueError` naming `tier` otherwise."""
    if tier not in TIERS:
        raise ValueError(f"tier: expected 'device' or 'host', got {tier!r}")
    return str(tier)
