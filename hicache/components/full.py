"""Full-attention KV: the base component, stored in a node's own `device_value` and `host_value`.

It needs no hooks: every token of every cached prefix has its full-attention KV, the tree's core
matches, splits and evicts it, and every other component's value on a tier requires it on that tier.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FULL", "FullAttention"]


@dataclass(frozen=True)
class FullAttention:
    """The base component's description (its pools are the cache's device and host pools).

    Attributes:
        name: `"full"`.
        rank: 0, the lowest: it is evicted last, and evicting it evicts every other component.
    """

    name: str = "full"
    rank: int = 0


FULL = FullAttention()
"""The one full-attention component."""
