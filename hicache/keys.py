"""Token keys, the namespace of a cache, and the chained per-page hash that names pages in storage.

Keys are converted once per request into `bytes` of little-endian int64 token ids (`as_key_bytes`): slicing
and comparing bytes runs in C, which is what makes matching cost follow the key rather than the tree. The
converted bytes are themselves a key that every call taking tokens accepts without converting again.
"""

from __future__ import annotations

import json
import struct
import sys
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt
import torch
import xxhash

try:
    from _hicache_native import chain_hashes as _chain_hashes
    from _hicache_native import chain_page_keys as _chain_page_keys
except ImportError as exc:  # pragma: no cover - only on an install that skipped the build
    # The same import through storage_backends.native raises the error that says how to build it. (Not
    # imported from there first: that package pulls in anyio, which the tree must not.)
    import storage_backends.native  # noqa: F401

    raise ImportError(
        f"{exc}: hicache's C extension is older than this checkout; rebuild it with `make venv`, "
        "`pip install -e .` or `python setup.py build_ext --inplace`"
    ) from exc

__all__ = [
    "NAMESPACE_ENCODING_VERSION",
    "ROOT_HASH",
    "TOKEN_BYTES",
    "KeyLike",
    "Namespace",
    "as_key_bytes",
    "chained_page_hashes",
    "chained_page_keys",
    "key_to_tensor",
    "num_tokens",
]

TOKEN_BYTES = 8
"""Bytes per token id in a key (int64)."""

ROOT_HASH = b"\x00" * 16
"""The hash that precedes the first page of every key."""

KeyLike: TypeAlias = "bytes | bytearray | memoryview | array[int] | torch.Tensor | npt.NDArray[np.integer[Any]] | Sequence[int]"
"""What callers may pass as a key: int64 bytes (an already converted key), `array('q')`, a 1-D integer tensor,
a 1-D numpy integer array or a sequence of ints."""

_LITTLE = sys.byteorder == "little"
_INT64_LE = np.dtype("<i8")
_MAX_STRUCTS = 4096
"""Packers kept for this many distinct key lengths (one `struct.Struct` each, about 100 bytes)."""
_structs: dict[int, Callable[..., bytes]] = {}


def as_key_bytes(tokens: KeyLike, *, name: str = "key") -> bytes:
    """Convert a key to little-endian int64 bytes: convert once per request, then pass the bytes around.

    The result is itself a key: `RadixTree.match_prefix`/`insert` and `HiCache.match`/`acquire`/`insert`
    take it as is, without converting again, so a request converts its tokens once (`HiCache.acquire`
    does it and keeps the bytes on the `Lease`).

    A list or tuple of ints is packed by one cached `struct.Struct` per length (faster than `array('q')`:
    `bench/bench_tree.py`'s `key_convert_us`); numpy arrays and tensors are viewed, not iterated.

    Args:
        tokens: token ids as int64 bytes, `array('q')`, a 1-D integer tensor, a 1-D numpy integer array,
            or a sequence of ints.
        name: the argument name used in error messages.

    Raises:
        TypeError: for an unsupported type, a non-integer element, tensor or array dtype.
        ValueError: for bytes whose length is not a multiple of 8, a tensor or array that is not 1-D, or a
            token id outside int64 (-2**63 .. 2**63 - 1).
    """
    if isinstance(tokens, list | tuple):
        n = len(tokens)
        pack = _structs.get(n)
        if pack is None:
            pack = _packer(n)
        try:
            return pack(*tokens)
        except struct.error:
            return _int64_array(tokens, name).tobytes()  # raises naming `name`
    if isinstance(tokens, bytes):
        if len(tokens) % TOKEN_BYTES:
            raise ValueError(
                f"{name}: bytes length must be a multiple of 8 (int64 tokens), got {len(tokens)}"
            )
        return tokens
    if isinstance(tokens, np.ndarray):
        return _numpy_key(tokens, name)
    if isinstance(tokens, bytes | bytearray | memoryview):
        return as_key_bytes(bytes(tokens), name=name)
    if isinstance(tokens, array):
        if tokens.typecode != "q":
            tokens = _int64_array(tokens, name)
        if not _LITTLE:  # pragma: no cover - big-endian hosts
            tokens = array("q", tokens)
            tokens.byteswap()
        return tokens.tobytes()
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1:
            raise ValueError(f"{name}: expected a 1-D tensor, got shape {tuple(tokens.shape)}")
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise TypeError(f"{name}: expected an integer tensor, got dtype {tokens.dtype}")
        if tokens.dtype == torch.uint64 and bool((tokens.view(torch.int64) < 0).any()):
            # A uint64 id >= 2**63 would wrap to a negative int64: another key, silently.
            raise ValueError(f"{name}: token ids must fit in int64 (< 2**63), got a uint64 id >= 2**63")
        t = tokens.detach().to(device="cpu", dtype=torch.int64).contiguous()
        return t.numpy().tobytes() if _LITTLE else array("q", t.tolist()).tobytes()
    if isinstance(tokens, str):
        raise TypeError(f"{name}: expected token ids, got str")
    if isinstance(tokens, Sequence):
        try:
            return _int64_array(tokens, name).tobytes()
        except TypeError as exc:
            raise TypeError(f"{name}: expected a sequence of ints, got {type(tokens).__name__}") from exc
    raise TypeError(
        f"{name}: expected bytes, array('q'), a 1-D tensor, a 1-D numpy integer array or a sequence of ints, "
        f"got {type(tokens)!r}"
    )


def _packer(n: int) -> Callable[..., bytes]:
    """`struct.Struct('<{n}q').pack`, kept for the next key of this length (the cache is bounded)."""
    pack = struct.Struct(f"<{n}q").pack
    if len(_structs) >= _MAX_STRUCTS:
        _structs.clear()
    _structs[n] = pack
    return pack


def _numpy_key(tokens: npt.NDArray[Any], name: str) -> bytes:
    """A 1-D numpy integer array as key bytes (one copy at most)."""
    if tokens.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D array, got shape {tokens.shape}")
    kind = tokens.dtype.kind
    if kind not in "iu":
        raise TypeError(f"{name}: expected an integer array, got dtype {tokens.dtype}")
    if kind == "u" and tokens.dtype.itemsize == 8 and tokens.size and int(tokens.max()) >= 1 << 63:
        raise ValueError(f"{name}: token ids must fit in int64 (< 2**63), got a uint64 id >= 2**63")
    return tokens.astype(_INT64_LE, copy=False).tobytes()


def _int64_array(tokens: Sequence[int] | array[int], name: str) -> array[int]:
    """`tokens` as `array('q')`; an id outside int64 raises `ValueError` naming `name`."""
    try:
        return array("q", tokens)
    except OverflowError:
        low, high = -(1 << 63), (1 << 63) - 1
        bad = next((t for t in tokens if isinstance(t, int) and not low <= t <= high), None)
        raise ValueError(f"{name}: token ids must fit in int64 ({low} .. {high}), got {bad}") from None
    except TypeError as exc:
        raise TypeError(f"{name}: expected a sequence of ints, got an element that is not: {exc}") from None


def num_tokens(key: bytes) -> int:
    """Number of tokens in a key in bytes form."""
    return len(key) // TOKEN_BYTES


def key_to_tensor(key: bytes) -> torch.Tensor:
    """The token ids of a key in bytes form as a 1-D int64 tensor (a copy)."""
    if not key:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(bytearray(key), dtype=torch.int64)


NAMESPACE_ENCODING_VERSION = 2
"""The version written into every namespace encoding (1 was the unescaped, separator-joined form)."""


@dataclass(frozen=True, slots=True)
class Namespace:
    """Everything that makes two pages with the same tokens hold different bytes.

    Two caches share pages in storage only when every field matches: the page hashes (and so the storage
    keys) chain the namespace's `digest`, and every stored page's header carries it.

    The caller fills the identity fields; `HiCacheConfig` fills `layout` from its KV layout and components
    (a value passed in is replaced), so two caches with different page bytes never share a namespace, whatever
    the caller passes.

    Attributes:
        model_id: the model's identity as the serving engine knows it: its name and revision, or a hash of
            its config and weights. Empty means unknown (a cache with storage then logs a warning at start).
        tp_rank: this process's tensor-parallel rank (0 <= tp_rank < tp_size).
        tp_size: the tensor-parallel world size (>= 1).
        extra: any further discriminator the caller wants (a run id, a quantisation recipe).
        layout: the canonical description of the page bytes (`HiCacheConfig.layout_signature`); empty
            only for namespaces used outside a cache (a bare tree, tests).

    Raises:
        TypeError, ValueError: naming the field that is out of range or of the wrong type.
    """

    model_id: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    extra: str = ""
    layout: str = ""
    _encoded: bytes = field(default=b"", init=False, repr=False, compare=False)
    _digest: bytes = field(default=b"", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("model_id", "extra", "layout"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise TypeError(f"{name}: expected a str, got {type(value).__name__}")
        for name in ("tp_rank", "tp_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
        if self.tp_size < 1:
            raise ValueError(f"tp_size: expected >= 1, got {self.tp_size}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank: expected 0 <= tp_rank < tp_size ({self.tp_size}), got {self.tp_rank}")
        encoded = json.dumps(
            {
                "v": NAMESPACE_ENCODING_VERSION,
                "model_id": self.model_id,
                "tp_rank": self.tp_rank,
                "tp_size": self.tp_size,
                "extra": self.extra,
                "layout": self.layout,
            },
            sort_keys=True,
            separators=(",", ":"),
            ensure_ascii=True,
        ).encode("ascii")
        object.__setattr__(self, "_encoded", encoded)
        object.__setattr__(self, "_digest", xxhash.xxh3_128_digest(encoded))

    @property
    def encoding(self) -> bytes:
        """The unambiguous, versioned encoding of every field: canonical JSON (sorted keys, no spaces,
        ASCII only, strings escaped), with `"v"` = `NAMESPACE_ENCODING_VERSION`. Distinct fields give
        distinct encodings: `json.loads` gives the fields back."""
        return self._encoded

    @property
    def digest(self) -> bytes:
        """A stable 16-byte digest of `encoding` (xxh3-128: the same on every process and machine)."""
        return self._digest


def _check_chain(page_size: int, prev: bytes) -> None:
    """Refuse a page size or a previous page's hash that no chain of page hashes can start from."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if len(prev) != 16:
        raise ValueError(f"prev must be a 16-byte hash, got {len(prev)} bytes")


def chained_page_hashes(
    key: bytes, page_size: int, namespace: Namespace, prev: bytes = ROOT_HASH
) -> list[bytes]:
    """One 16-byte hash per full page of `key`: digest(previous page's hash, namespace, this page's tokens).

    Stable across processes and machines (xxh3-128, never Python's `hash()`); a trailing partial page
    gets no hash.

    Args:
        key: the key in bytes form, starting right after the page whose hash is `prev`.
        page_size: tokens per page (>= 1).
        namespace: the cache's namespace.
        prev: the hash of the page before `key` (`ROOT_HASH` at the start of a sequence).
    """
    _check_chain(page_size, prev)
    # In C: the loop in Python cost ~4 us a page on the event loop (a 1,024-page prefetch: ~4 ms).
    return _chain_hashes(key, page_size * TOKEN_BYTES, namespace.digest, prev)


def chained_page_keys(
    key: bytes, page_size: int, namespace: Namespace, prev: bytes = ROOT_HASH
) -> tuple[list[bytes], list[str]]:
    """`chained_page_hashes` (same arguments), and each hash's storage key (its 32 lowercase hex digits),
    aligned."""
    _check_chain(page_size, prev)
    # In C with the hashes: `[h.hex() for h in hashes]` cost ~30 us per 1,024 pages on the event loop.
    return _chain_page_keys(key, page_size * TOKEN_BYTES, namespace.digest, prev)
