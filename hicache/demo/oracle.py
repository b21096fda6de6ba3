"""The demo's test oracle: reference copies of the K/V the model produced, kept per page of token prefix.

This is not a cache. It keeps, for every full page the model ever produced K/V for, the exact tensors the
model's own `DynamicCache` held (in transformers' per-layer layout, never converted to the pool layout), so
that K/V restored from any tier can be checked bit for bit, and a forward pass from the model's own
in-memory cache can be compared with one from the restored cache.

The same tokens can have K/V that differ in the last bits when they were computed in different chunks
(a matrix product's rounding depends on its shape), so a page may have more than one recorded version;
restored K/V must equal one of them exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hicache.keys import Namespace, as_key_bytes, chained_page_hashes

__all__ = ["KVOracle", "OracleCheck"]

_Page = tuple[tuple[torch.Tensor, torch.Tensor], ...]
"""One page of K/V: per layer `(keys, values)`, each `(1, num_kv_heads, page_size, head_dim)`."""


@dataclass(frozen=True, slots=True)
class OracleCheck:
    """The result of comparing restored K/V with the oracle.

    Attributes:
        pages: full pages compared.
        mismatched_pages: page numbers whose restored K/V equal no recorded version (or that were never
            recorded).
        reference_cache: a `DynamicCache` built from the recorded tensors (the matching version of each
            page), as the model's own in-memory cache would hold them.
    """

    pages: int
    mismatched_pages: tuple[int, ...]
    reference_cache: Any

    @property
    def ok(self) -> bool:
        """Whether every page matched a recorded version bit for bit."""
        return not self.mismatched_pages


class KVOracle:
    """Reference K/V by chained page hash of the token prefix.

    Args:
        page_size: tokens per page, as in the cache.
        namespace: used only to hash token prefixes.
    """

    def __init__(self, page_size: int, namespace: Namespace | None = None) -> None:
        if page_size < 1:
            raise ValueError(f"page_size: expected >= 1, got {page_size}")
        self.page_size = page_size
        self._namespace = namespace if namespace is not None else Namespace(model_id="demo-oracle")
        self._pages: dict[bytes, list[_Page]] = {}

    def __repr__(self) -> str:
        versions = sum(len(v) for v in self._pages.values())
        return f"KVOracle(page_size={self.page_size}, pages={len(self._pages)}, versions={versions})"

    @property
    def num_pages(self) -> int:
        """Distinct token-prefix pages recorded."""
        return len(self._pages)

    def _hashes(self, tokens: torch.Tensor, end: int) -> list[bytes]:
        return chained_page_hashes(as_key_bytes(tokens[:end], name="tokens"), self.page_size, self._namespace)

    def record(self, tokens: torch.Tensor, cache: Any, start: int, end: int) -> int:
        """Record the full pages of `tokens` within `[start, end)` from the model's own `DynamicCache`.

        Args:
            tokens: the sequence the cache was computed for (at least `end` tokens).
            cache: the model's `DynamicCache` holding at least `end` positions.
            start: first position the model computed itself (pages before it came from elsewhere).
            end: one past the last position with K/V in `cache`.

        Returns:
            The number of new versions recorded (pages already recorded with identical bits are skipped).
        """
        size = self.page_size
        hashes = self._hashes(tokens, end)
        added = 0
        for page in range(-(-start // size), end // size):
            s, e = page * size, (page + 1) * size
            data = tuple(
                (layer.keys[:, :, s:e, :].clone(), layer.values[:, :, s:e, :].clone())
                for layer in cache.layers
            )
            versions = self._pages.setdefault(hashes[page], [])
            if not any(_page_equal(v, data) for v in versions):
                versions.append(data)
                added += 1
        return added

    def check(self, tokens: torch.Tensor, restored: Any, config: Any = None) -> OracleCheck:
        """Compare the K/V of a restored `DynamicCache` (covering a page-aligned prefix) with the oracle.

        Args:
            tokens: the request's tokens (at least as many as `restored` covers).
            restored: the `DynamicCache` built from K/V read out of the cache's device pool.
            config: the model's config, for the reference `DynamicCache`.
        """
        from transformers import DynamicCache

        length = int(restored.get_seq_length())
        size = self.page_size
        if length % size:
            raise ValueError(f"restored: covers {length} tokens, not a multiple of page_size={size}")
        hashes = self._hashes(tokens, length)
        chosen: list[_Page] = []
        bad: list[int] = []
        for page, h in enumerate(hashes):
            s, e = page * size, (page + 1) * size
            got = tuple((layer.keys[:, :, s:e, :], layer.values[:, :, s:e, :]) for layer in restored.layers)
            versions = self._pages.get(h, [])
            match = next((v for v in versions if _page_equal(v, got)), None)
            if match is None:
                bad.append(page)
                match = versions[0] if versions else tuple((k.clone(), v.clone()) for k, v in got)
            chosen.append(match)
        reference = DynamicCache(config=config) if config is not None else DynamicCache()
        if chosen:
            for layer_idx in range(len(chosen[0])):
                keys = torch.cat([p[layer_idx][0] for p in chosen], dim=2)
                values = torch.cat([p[layer_idx][1] for p in chosen], dim=2)
                reference.update(keys, values, layer_idx)
        return OracleCheck(pages=len(hashes), mismatched_pages=tuple(bad), reference_cache=reference)


def _page_equal(a: _Page, b: _Page) -> bool:
    return len(a) == len(b) and all(
        torch.equal(ka, kb) and torch.equal(va, vb) for (ka, va), (kb, vb) in zip(a, b, strict=True)
    )
