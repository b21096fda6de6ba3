"""The hybrid demo's test oracle: reference copies of the K/V, window and state the hybrid model produced.

As `KVOracle` does for the Llama demo, this keeps (by chained page hash of the token prefix) the exact
tensors the model's own cache held, so that a prefix restored from any tier can be checked bit for bit:
full-attention and sliding-window K/V per page, recurrent states per prefix end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hicache.demo.hybrid import HybridModel, HybridParts
from hicache.keys import Namespace, as_key_bytes, chained_page_hashes

__all__ = ["HybridCheck", "HybridOracle"]

_Pairs = tuple[tuple[torch.Tensor, torch.Tensor], ...]


@dataclass(frozen=True, slots=True)
class HybridCheck:
    """The result of comparing a restored prefix with the oracle.

    Attributes:
        mismatched: what differed: `full@page`, `swa@page` or `state`, or never recorded.
        reference: the prefix built from the recorded tensors (the restored value's matching version).
    """

    mismatched: tuple[str, ...]
    reference: HybridParts

    @property
    def ok(self) -> bool:
        """Whether the restored K/V, window and state all equal recorded versions bit for bit."""
        return not self.mismatched


class HybridOracle:
    """Reference copies of what the hybrid model produced, by chained page hash of the token prefix.

    Full-attention and sliding-window K/V are kept per page; states per prefix end. As in `KVOracle`, the
    same tokens computed in different chunks may differ in the last bits, so each entry may have several
    versions; a restored value must equal one of them exactly.

    Args:
        model: the model whose tensors are recorded.
        page_size: tokens per page, as in the cache.
    """

    def __init__(self, model: HybridModel, page_size: int) -> None:
        if page_size < 1:
            raise ValueError(f"page_size: expected >= 1, got {page_size}")
        self.model = model
        self.page_size = page_size
        self._namespace = Namespace(model_id="demo-hybrid-oracle")
        self._full: dict[bytes, list[_Pairs]] = {}
        self._swa: dict[bytes, list[_Pairs]] = {}
        self._states: dict[bytes, list[_Pairs]] = {}

    def __repr__(self) -> str:
        return (
            f"HybridOracle(page_size={self.page_size}, full_pages={len(self._full)}, "
            f"swa_pages={len(self._swa)}, states={len(self._states)})"
        )

    def _hashes(self, tokens: torch.Tensor, end: int) -> list[bytes]:
        return chained_page_hashes(as_key_bytes(tokens[:end], name="tokens"), self.page_size, self._namespace)

    def record(
        self, tokens: torch.Tensor, cache: Any, start: int, end: int, states: dict[int, torch.Tensor]
    ) -> None:
        """Record the full pages of `[start, end)` the model computed into `cache`, and the packed states.

        Args:
            tokens: the sequence (at least `end` tokens).
            cache: the model's recording cache, restored at `start` (or empty with `start` 0).
            start: the first position the model computed itself.
            end: one past the last position with K/V in `cache`.
            states: position -> packed state at that position (kept at page boundaries only).
        """
        size = self.page_size
        hashes = self._hashes(tokens, end)
        model = self.model
        for page in range(-(-start // size), end // size):
            s, e = page * size, (page + 1) * size
            full = tuple(
                (k.clone(), v.clone()) for k, v in model.recorded_pairs(cache, model.full_layers, s, e)
            )
            swa = tuple(
                (k.clone(), v.clone()) for k, v in model.recorded_pairs(cache, model.swa_layers, s, e)
            )
            _add_version(self._full, hashes[page], full)
            _add_version(self._swa, hashes[page], swa)
        for pos, packed in states.items():
            if pos > 0 and pos % size == 0 and pos <= end:
                _add_version(self._states, hashes[pos // size - 1], model.unpack_state(packed))

    def check(self, tokens: torch.Tensor, restored: HybridParts) -> HybridCheck:
        """Compare a restored prefix (page-aligned) with the recorded tensors."""
        length = restored.length
        size = self.page_size
        if length % size or length < 1:
            raise ValueError(f"restored: covers {length} tokens, not a positive multiple of page_size={size}")
        hashes = self._hashes(tokens, length)
        bad: list[str] = []
        full_pages = [
            _choose(self._full, hashes[p], _slice(restored.full, p * size, (p + 1) * size), f"full@{p}", bad)
            for p in range(length // size)
        ]
        first = length - int(restored.swa[0][0].shape[2]) if restored.swa else length
        swa_pages = [
            _choose(
                self._swa,
                hashes[p],
                _slice(restored.swa, p * size - first, (p + 1) * size - first),
                f"swa@{p}",
                bad,
            )
            for p in range(first // size, length // size)
        ]
        state = _choose(self._states, hashes[-1], restored.states, "state", bad)
        reference = HybridParts(length=length, full=_concat(full_pages), swa=_concat(swa_pages), states=state)
        return HybridCheck(mismatched=tuple(bad), reference=reference)


def _add_version(store: dict[bytes, list[_Pairs]], key: bytes, data: _Pairs) -> None:
    versions = store.setdefault(key, [])
    if not any(_pairs_equal(v, data) for v in versions):
        versions.append(data)


def _choose(store: dict[bytes, list[_Pairs]], key: bytes, got: _Pairs, label: str, bad: list[str]) -> _Pairs:
    """The recorded version equal to `got`; else note `label` in `bad` and return a stand-in."""
    versions = store.get(key, [])
    match = next((v for v in versions if _pairs_equal(v, got)), None)
    if match is None:
        bad.append(label)
        return versions[0] if versions else tuple((a.clone(), b.clone()) for a, b in got)
    return match


def _pairs_equal(a: _Pairs, b: _Pairs) -> bool:
    return len(a) == len(b) and all(
        torch.equal(ka, kb) and torch.equal(va, vb) for (ka, va), (kb, vb) in zip(a, b, strict=True)
    )


def _slice(pairs: _Pairs, start: int, end: int) -> _Pairs:
    return tuple((k[:, :, start:end], v[:, :, start:end]) for k, v in pairs)


def _concat(pages: list[_Pairs]) -> _Pairs:
    if not pages:
        return ()
    return tuple(
        (torch.cat([p[i][0] for p in pages], dim=2), torch.cat([p[i][1] for p in pages], dim=2))
        for i in range(len(pages[0]))
    )
