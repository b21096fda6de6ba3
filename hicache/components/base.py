"""The component protocol: what one kind of per-node state (beyond full-attention KV) must say.

A hybrid model keeps more than full-attention KV per prefix: sliding-window KV (`swa.py`) or a recurrent
state snapshot (`mamba.py`). Each kind is a *component*: it has its own device and host pools and, per tree
node and tier, a value (pool indices) or nothing. The tree stores component values in `ComponentData`
records and calls the component's hooks for what differs between kinds (how values split, whether a
prefix ending at a node is usable, how an inserted value is spread over the nodes of a path). Everything
else (counters, locks, eviction sets, cascades, `sanity_check`) is generic, so adding a kind of component
touches one module.

Full-attention KV is the base component (`full.py`): it lives in the node's own `device_value` and
`host_value` fields, and every component value on a tier requires the base value on that tier.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from hicache.memory.layout import KVLayout

if TYPE_CHECKING:
    from hicache.tree.node import TreeNode

__all__ = ["TIERS", "Component", "ComponentData", "ComponentFree", "ValueGetter"]

TIERS = ("device", "host")
"""The tiers a component value can live on."""

ValueGetter = Callable[["TreeNode"], "torch.Tensor | None"]
"""Returns a node's value of one component on the tier being checked (`None`: absent there)."""


class ComponentData:
    """One component's state on one node: a value per tier, an in-flight backup, and lock counts.

    Attributes:
        device_value: indices into the component's device pool, or `None` (absent or a tombstone).
        host_value: indices into the component's host pool, or `None`.
        backup_pending: host indices of a device-to-host backup in flight, else `None`.
        device_lock: holders protecting the device value from component eviction.
        host_lock: holders protecting the host value from component eviction.
    """

    __slots__ = ("backup_pending", "device_lock", "device_value", "host_lock", "host_value")

    def __init__(self) -> None:
        self.device_value: torch.Tensor | None = None
        self.host_value: torch.Tensor | None = None
        self.backup_pending: torch.Tensor | None = None
        self.device_lock = 0
        self.host_lock = 0

    def value(self, tier: str) -> torch.Tensor | None:
        """The value on `tier` (`"device"` or `"host"`)."""
        return self.device_value if tier == "device" else self.host_value

    @property
    def empty(self) -> bool:
        """No value, no backup in flight and no lock: the record can be dropped."""
        return (
            self.device_value is None
            and self.host_value is None
            and self.backup_pending is None
            and not self.device_lock
            and not self.host_lock
        )

    def __repr__(self) -> str:
        def size(v: torch.Tensor | None) -> str:
            return "-" if v is None else str(int(v.numel()))

        return (
            f"ComponentData(device={size(self.device_value)}, host={size(self.host_value)}, "
            f"pending={size(self.backup_pending)}, locks=({self.device_lock}, {self.host_lock}))"
        )


class ComponentFree:
    """Indices of one component the tree let go of; the controller returns them to the tier's pool.

    Attributes:
        component: the component's name.
        tier: `"device"` or `"host"`.
        indices: int64 indices into that component's pool on that tier.
    """

    __slots__ = ("component", "indices", "tier")

    def __init__(self, component: str, tier: str, indices: torch.Tensor) -> None:
        self.component = component
        self.tier = tier
        self.indices = indices

    def __repr__(self) -> str:
        return f"ComponentFree({self.component!r}, {self.tier!r}, {int(self.indices.numel())} indices)"


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

    def valid_end(self, node: TreeNode, root: TreeNode, get: ValueGetter) -> bool:
        """Whether a prefix ending at the end of `node` can be used, reading values through `get`."""
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
