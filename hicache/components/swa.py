"""Sliding-window attention KV: a prefix needs only the KV of its last `window` tokens.

Per node and tier the value covers a *suffix* of the node's tokens (whole pages, one pool index per
token), or nothing. A node whose base KV is on a tier but whose window KV is not is a tombstone there: the
node still serves full attention and deeper matches, but a prefix can end at a node only when the
`window` tokens before that end all have their window KV on the tier.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hicache.components.base import PathValues
from hicache.layout import KVLayout

__all__ = ["SlidingWindow"]


@dataclass(frozen=True)
class SlidingWindow:
    """Sliding-window KV as a component.

    Attributes:
        window: tokens of KV a prefix needs, counted back from its end (>= 1).
        layout: the layout of one page of window KV (its page size must equal the cache's).
        device_pages: pages in the component's device pool.
        host_pages: pages in the component's host pool.
        name: the component's name (unique in a cache; a suffix of its storage keys).
        rank: eviction order (above the base, below Mamba).

    Raises:
        ValueError, TypeError: a field out of range or of the wrong type.
    """

    window: int
    layout: KVLayout
    device_pages: int
    host_pages: int
    name: str = "swa"
    rank: int = 1

    def __post_init__(self) -> None:
        for field_name in ("window", "device_pages", "host_pages", "rank"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{field_name}: expected an int >= 1, got {value!r}")
        if not isinstance(self.layout, KVLayout):
            raise TypeError(f"layout: expected a KVLayout, got {type(self.layout).__name__}")
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(f"name: expected an identifier, got {self.name!r}")

    @property
    def lock_path(self) -> bool:
        """Window KV is locked along the whole path (a split copies the lock to both parts)."""
        return True

    def pool_layout(self, page_size: int) -> KVLayout:
        """The configured layout; its page size must equal the tree's."""
        if self.layout.page_size != page_size:
            raise ValueError(
                f"layout: the {self.name!r} page size {self.layout.page_size} differs from the cache's {page_size}"
            )
        return self.layout

    def check_value(self, value: torch.Tensor, num_tokens: int, page_size: int) -> str | None:
        """A suffix of the node: 1 to `num_tokens` entries, whole pages."""
        k = int(value.shape[0])
        if k < 1 or k > num_tokens or k % page_size:
            return f"{k} entries is not a non-empty page-aligned suffix of {num_tokens} tokens"
        return None

    def split(
        self, value: torch.Tensor, upper_tokens: int, num_tokens: int
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The lower part keeps the suffix's last tokens; the upper part gets what reaches into it."""
        k = int(value.shape[0])
        lower_tokens = num_tokens - upper_tokens
        if k <= lower_tokens:
            return None, value
        return value[: k - lower_tokens], value[k - lower_tokens :]

    def valid_end(self, path: PathValues) -> bool:
        """Every one of the `window` tokens before the prefix's end has its window KV."""
        remaining = self.window
        for n, value in path:
            need = n if remaining >= n else remaining
            if value is None or int(value.shape[0]) < need:
                return False
            remaining -= n
            if remaining <= 0:
                break
        return True

    def distribute(
        self, spans: Sequence[tuple[int, int]], values: torch.Tensor, end: int, key_tokens: int
    ) -> list[torch.Tensor | None]:
        """`values` cover the last `len(values)` tokens before `end`; each span takes its part of them."""
        start = end - int(values.shape[0])
        out: list[torch.Tensor | None] = []
        for s, e in spans:
            lo = s if s > start else start
            out.append(values[lo - start : e - start] if lo < e else None)
        return out

    def prefix_pages(self, num_tokens: int, page_size: int) -> int:
        """The window's pages at the end of a prefix of `num_tokens` tokens."""
        return -(-min(self.window, num_tokens) // page_size)

    def page_hash_index(self, num_pages: int, value: torch.Tensor, page_size: int) -> list[int]:
        """The value covers the node's last `len(value) // page_size` pages."""
        pages = int(value.shape[0]) // page_size
        return list(range(num_pages - pages, num_pages))
