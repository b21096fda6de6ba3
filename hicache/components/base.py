"""The component protocol: what one kind of per-node state (beyond full-attention KV) must say.

A hybrid model keeps more than full-attention KV per prefix: sliding-window KV (`swa.py`) or a recurrent
state snapshot (`mamba.py`). Each kind is a *component*: it has its own device and host pools and, per tree
node and tier, a value (pool indices) or nothing. The tree stores component values in per-node
records and calls the component's hooks for what differs between kinds (how values split, whether a
prefix ending at a node is usable, how an inserted value is spread over the nodes of a path). The hooks
see values and token counts, never tree nodes: components import nothing of the tree. Everything
else (counters, locks, eviction sets, cascades, `sanity_check`) is generic, so adding a kind of component
touches one module.

Full-attention KV is the base component: it is not a `Component` (it needs no hooks: the tree's core
matches, splits and evicts it), lives in the node's own device and host values, and every component
value on a tier requires the base value on that tier.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

import torch

from hicache.layout import KVLayout
from hicache.tiers import Tier

__all__ = ["TIERS", "Component", "PathValues"]

TIERS = (Tier.DEVICE, Tier.HOST)
"""The tiers a component value can live on."""

PathValues = Iterable[tuple[int, "torch.Tensor | None"]]
"""The nodes of a prefix from its end back towards the root, lazily: per node its token count and its value
of one component on the tier being checked (`None`: absent there). Empty for the empty prefix."""


@runtime_checkable
class Component(Protocol):
    """What the tree and the controller need from one kind of hybrid-model state.

    Components are immutable descriptions (frozen dataclasses); their per-node data lives in the tree.
    A tree orders its components by `rank`: evicting one cascades to those of higher rank on the same node
    (full attention > sliding window > Mamba: the base is kept longest, Mamba goes first).
    """

    @property
    def name(self) -> str:
        """Unique among a cache's components; also the suffix of its storage keys."""
        ...

    @property
    def rank(self) -> int:
        """Eviction order: a component of higher rank goes before (and with) those of lower rank."""
        ...

    @property
    def device_pages(self) -> int:
        """Pages of the component's device pool (its layout's pages)."""
        ...

    @property
    def host_pages(self) -> int:
        """Pages of the component's host pool."""
        ...

    @property
    def lock_path(self) -> bool:
        """`True`: a lock on a node also protects this component on every ancestor (like the base);
        `False`: only on the node itself."""
        ...

    def pool_layout(self, page_size: int) -> KVLayout:
        """The layout of this component's pools in a tree of `page_size`-token pages."""
        ...

    def check_value(self, value: torch.Tensor, num_tokens: int, page_size: int) -> str | None:
        """Why `value` is malformed for a node of `num_tokens` tokens (`None` when it is fine)."""
        ...

    def split(
        self, value: torch.Tensor, upper_tokens: int, num_tokens: int
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Split the value of a node of `num_tokens` tokens whose first `upper_tokens` become a new parent:
        `(upper part, lower part)` (the original node keeps the lower part)."""
        ...

    def valid_end(self, path: PathValues) -> bool:
        """Whether a prefix can end where `path` starts (its last node), reading as few nodes as it needs."""
        ...

    def distribute(
        self, spans: Sequence[tuple[int, int]], values: torch.Tensor, end: int, key_tokens: int
    ) -> list[torch.Tensor | None]:
        """Spread values given for a page-aligned key ending at token `end` over the nodes of `spans`.

        `spans` are the `[start, stop)` token ranges of consecutive nodes, the last stopping at `end`;
        `key_tokens` is the caller's key length before alignment (a state taken there is not at `end`
        when the key had a partial last page).
        Returns one value (or `None`) per span; indices not handed out are freed by the tree.
        """
        ...

    def prefix_pages(self, num_tokens: int, page_size: int) -> int:
        """How many of the last pages of a `num_tokens`-token prefix have a page of this component
        (storage reads them, all or nothing, with a prefetch ending there)."""
        ...

    def page_hash_index(self, num_pages: int, value: torch.Tensor, page_size: int) -> list[int]:
        """Which of a node's `num_pages` page hashes name the storage pages of `value`, in pool order."""
        ...
