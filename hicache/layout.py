"""The shape of one page of KV cache: what a pool stores per page, page-first (a leaf module: torch only)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PAGE_FIRST_LAYOUT_VERSION", "KVLayout"]

PAGE_FIRST_LAYOUT_VERSION = 1
"""The version of the page-first byte order of a page (`KVLayout.page_shape`, C order). Part of every
cache's namespace: bump it when the order of bytes inside a page changes, so old pages stop matching."""


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {value!r}")


@dataclass(frozen=True)
class KVLayout:
    """The per-page layout of a KV pool.

    A page holds ``page_size`` tokens of K and V for every layer, shaped
    ``(num_layers, planes, page_size, num_kv_heads, head_dim)``; ``planes`` is 2 (K and V) for attention
    KV and 1 for a flat per-token byte layout (see `flat`).

    Attributes:
        num_layers: layers per page.
        num_kv_heads: KV heads per layer.
        head_dim: elements per head.
        dtype: element type.
        page_size: tokens per page.
        planes: 2 for K and V, 1 for flat layouts.

    Raises:
        ValueError: naming the field that is out of range.
        TypeError: when `dtype` is not a `torch.dtype`.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    page_size: int
    planes: int = 2

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            _check_positive(name, getattr(self, name))
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"dtype: expected a torch.dtype, got {self.dtype!r}")
        if self.planes not in (1, 2) or isinstance(self.planes, bool):
            raise ValueError(f"planes: expected 1 or 2, got {self.planes!r}")

    @classmethod
    def flat(cls, nbytes_per_token: int, page_size: int) -> KVLayout:
        """A generic layout of `nbytes_per_token` opaque bytes per token (for non-attention components).

        Args:
            nbytes_per_token: bytes stored per token.
            page_size: tokens per page.
        """
        _check_positive("nbytes_per_token", nbytes_per_token)
        return cls(
            num_layers=1,
            num_kv_heads=1,
            head_dim=nbytes_per_token,
            dtype=torch.uint8,
            page_size=page_size,
            planes=1,
        )

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        """``(num_layers, planes, page_size, num_kv_heads, head_dim)``."""
        return (self.num_layers, self.planes, self.page_size, self.num_kv_heads, self.head_dim)

    @property
    def element_size(self) -> int:
        """Bytes per element of `dtype`."""
        return int(self.dtype.itemsize)

    @property
    def token_nbytes(self) -> int:
        """Bytes one token occupies across all layers and planes."""
        return self.num_layers * self.planes * self.num_kv_heads * self.head_dim * self.element_size

    @property
    def page_nbytes(self) -> int:
        """Bytes one page occupies: one contiguous range in a page-first pool."""
        return self.token_nbytes * self.page_size

    def signature(self) -> dict[str, int | str]:
        """Every field that decides the bytes of a page, for a namespace (see `hicache.keys.Namespace`)."""
        return {
            "num_layers": self.num_layers,
            "planes": self.planes,
            "page_size": self.page_size,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": str(self.dtype).removeprefix("torch."),
            "page_first": PAGE_FIRST_LAYOUT_VERSION,
        }

    def tokens_shape(self, num_tokens: int) -> tuple[int, int, int, int, int]:
        """The shape of `num_tokens` tokens as read or written: ``(num_layers, planes, n, heads, dim)``."""
        return (self.num_layers, self.planes, num_tokens, self.num_kv_heads, self.head_dim)
