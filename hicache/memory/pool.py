"""Page-first KV pools on the device or in (pinned when possible) host memory.

A pool's `buffer` has shape ``(num_pages, *layout.page_shape)``: one page's KV for all layers is one
contiguous byte range, so a page moves to storage or across devices as a single copy and a CPU page can be
handed to a storage backend as a zero-copy `memoryview`.
"""

from __future__ import annotations

import logging
import operator
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import overload

import numpy as np
import numpy.typing as npt
import torch

from hicache.errors import CacheClosed
from hicache.layout import KVLayout
from hicache.memory.allocator import Owner, PageAllocator, check_token_indices

__all__ = ["HostPool", "KVPool", "PoolStatistics", "make_device_pool", "make_host_pool"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolStatistics:
    """A snapshot of a pool's occupancy and placement."""

    name: str
    device: str
    capacity_pages: int
    free_pages: int
    used_pages: int
    page_size: int
    page_nbytes: int
    pinned: bool


def _allocate_buffer(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, pin_memory: bool | None, name: str
) -> tuple[torch.Tensor, bool]:
    """Allocate a zeroed buffer; return it and whether it is pinned.

    Three cases for a CPU buffer: `pin_memory=False` never pins; `None` pins when CUDA is available; `True`
    pins, falling back to pageable memory with a warning when no pinned allocator exists.
    """
    if device.type != "cpu":
        if pin_memory:
            raise ValueError(f"pin_memory: only applies to CPU pools, got device {device}")
        return torch.zeros(shape, dtype=dtype, device=device), False
    want_pin = torch.cuda.is_available() if pin_memory is None else pin_memory
    if want_pin:
        try:
            return torch.zeros(shape, dtype=dtype, pin_memory=True), True
        except RuntimeError as exc:
            if pin_memory:
                logger.warning("pool %r: pinned memory unavailable (%s); using pageable memory", name, exc)
    return torch.zeros(shape, dtype=dtype), False


class KVPool:
    """A page-first pool of KV pages with its own page allocator.

    A pool is a resource: close it with `close()`, `aclose()`, `with` or `async with`; one garbage-collected
    while still open warns with `ResourceWarning`.

    Args:
        layout: the shape of one page.
        num_pages: pages in the pool.
        device: where the buffer lives.
        pin_memory: for CPU pools, `None` pins when CUDA is available, `True` asks for pinned memory (and
            falls back to pageable memory with a logged warning when none can be allocated), `False` never
            pins. Must not be `True` for a non-CPU pool.
        name: a label for `repr`, statistics and logs.

    Raises:
        TypeError: when `layout` is not a `KVLayout`.
        ValueError: when `num_pages` is negative or `pin_memory=True` is asked for a non-CPU pool.
    """

    # Set last in `__init__`: a pool whose constructor failed reads as closed and does not warn in `__del__`.
    _buffer: torch.Tensor | None = None

    def __init__(
        self,
        layout: KVLayout,
        num_pages: int,
        *,
        device: str | torch.device = "cpu",
        pin_memory: bool | None = None,
        name: str = "",
    ) -> None:
        if not isinstance(layout, KVLayout):
            raise TypeError(f"layout: expected a KVLayout, got {type(layout).__name__}")
        self._layout = layout
        self._allocator = PageAllocator(num_pages, layout.page_size)
        self._device = torch.device(device)
        self._name = name
        buffer, self._pinned = _allocate_buffer(
            (num_pages, *layout.page_shape), layout.dtype, self._device, pin_memory, name
        )
        self._device = buffer.device
        # Flat byte view of the whole buffer for zero-copy page views (CPU only): a page view is one slice
        # of it, one small object, where a numpy row plus its memoryview cost ~20x more on the event loop.
        self._bytes: memoryview | None = None
        if self._device.type == "cpu":
            self._bytes = buffer.view(-1).view(torch.uint8).numpy().data
        self._buffer = buffer

    # -- properties -----------------------------------------------------------------------------------

    @property
    def layout(self) -> KVLayout:
        """The shape of one page."""
        return self._layout

    @property
    def allocator(self) -> PageAllocator:
        """The page allocator behind `alloc` and `free`."""
        return self._allocator

    @property
    def buffer(self) -> torch.Tensor:
        """The page-first tensor of shape ``(num_pages, *layout.page_shape)``.

        Raises:
            CacheClosed: after `close`.
        """
        if self._buffer is None:
            raise CacheClosed(f"pool {self._name!r} is closed")
        return self._buffer

    @property
    def device(self) -> torch.device:
        """Where the buffer lives."""
        return self._device

    @property
    def pinned(self) -> bool:
        """Whether the buffer is in pinned (page-locked) host memory."""
        return self._pinned

    @property
    def name(self) -> str:
        """The pool's label."""
        return self._name

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return self._layout.page_size

    @property
    def free_tokens(self) -> int:
        """Token slots in free pages now (what `statistics().free_pages` counts, without the snapshot)."""
        return self._allocator.free_pages * self._layout.page_size

    @property
    def closed(self) -> bool:
        """Whether `close` was called."""
        return self._buffer is None

    # -- allocation -----------------------------------------------------------------------------------

    def alloc(self, num_tokens: int, owner: Owner = Owner.LEASE) -> torch.Tensor | None:
        """Allocate whole pages tagged `owner`; see `PageAllocator.alloc`. `None` when not enough are free."""
        self._check_open()
        return self._allocator.alloc(num_tokens, owner)

    def set_owner(self, indices: torch.Tensor | npt.NDArray[np.int64], owner: Owner) -> None:
        """Re-tag allocated pages; see `PageAllocator.set_owner`."""
        self._allocator.set_owner(indices, owner)

    def owner_tags(self) -> torch.Tensor:
        """A copy of every page's `Owner` tag (uint8, by page id)."""
        return self._allocator.owner_tags()

    def check_owned(self, indices: object, owner: Owner, *, name: str = "indices") -> torch.Tensor:
        """Page ids of `indices` if they are whole, distinct pages tagged `owner`; see
        `PageAllocator.check_owned`."""
        return self._allocator.check_owned(indices, owner, name=name)

    def free(self, indices: torch.Tensor, owner: Owner = Owner.LEASE) -> None:
        """Give pages tagged `owner` back (default: the caller's own); see `PageAllocator.free`. On error
        nothing is freed."""
        self._check_open()
        self._allocator.free(indices, owner)

    def page_ids(self, indices: torch.Tensor, *, name: str = "indices") -> torch.Tensor:
        """Validated page ids of token indices of whole, aligned pages; see `PageAllocator.page_ids`."""
        return self._allocator.page_ids(indices, name=name)

    # -- zero-copy page access ------------------------------------------------------------------------

    def byte_view(self) -> memoryview:
        """A writable, zero-copy, flat byte view of the whole buffer (CPU pools only).

        Raises:
            ValueError: when the pool is not on the CPU.
            CacheClosed: after `close`.
        """
        self._check_open()
        if self._bytes is None:
            raise ValueError(f"byte_view: pool {self._name!r} is on {self._device}, not the CPU")
        return self._bytes

    def page_view(self, page_id: int) -> memoryview:
        """A writable, zero-copy byte view of page `page_id` (CPU pools only).

        The view keeps the buffer alive; writing it writes the pool.

        Raises:
            TypeError: when `page_id` is not an int.
            ValueError: when `page_id` is out of range or the pool is not on the CPU.
            CacheClosed: after `close`.
        """
        self._check_open()
        if self._bytes is None:
            raise ValueError(f"page_view: pool {self._name!r} is on {self._device}, not the CPU")
        try:
            page = operator.index(page_id)
        except TypeError as exc:
            raise TypeError(f"page_id: expected an int, got {type(page_id).__name__}") from exc
        if not 0 <= page < self._allocator.capacity_pages:
            raise ValueError(f"page_id: expected 0 <= page_id < {self._allocator.capacity_pages}, got {page}")
        size = self._layout.page_nbytes
        return self._bytes[page * size : page * size + size]

    def page_views(self, indices: torch.Tensor) -> PageViews:
        """Zero-copy byte views, one per page of the token indices `indices` (whole, aligned pages).

        Each view is built on first access (see `PageViews`): a prefetch of a thousand pages builds
        its views batch by batch as its reads start, not all in one burst of loop work.

        Raises:
            TypeError: when `indices` is not a 1-D int64 CPU tensor.
            PoolError: when `indices` is misaligned or foreign.
            ValueError: when the pool is not on the CPU.
        """
        pages = self.page_ids(indices)  # validated: in range and aligned
        self._check_open()
        flat = self._bytes
        if flat is None:
            raise ValueError(f"page_views: pool {self._name!r} is on {self._device}, not the CPU")
        size = self._layout.page_nbytes
        return PageViews(flat, (pages * size).tolist(), size)

    # -- token gather / scatter -----------------------------------------------------------------------

    def check_tokens(self, indices: object, *, name: str = "indices") -> torch.Tensor:
        """Check that `indices` is a 1-D int64 CPU tensor of this pool's token slots and return it.

        Raises:
            TypeError: naming `name` when `indices` is not a 1-D int64 CPU tensor.
            ValueError: naming `name` when an index is outside the pool.
        """
        checked = check_token_indices(indices, name=name)
        if checked.numel() and (
            int(checked.min()) < 0 or int(checked.max()) >= self._allocator.capacity_tokens
        ):
            raise ValueError(
                f"{name}: token indices must lie in [0, {self._allocator.capacity_tokens}) for pool "
                f"{self._name!r}"
            )
        return checked

    def _token_coords(self, indices: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        idx = self.check_tokens(indices, name=name).to(self._device)
        return idx // self.page_size, idx % self.page_size

    def read_tokens(self, indices: torch.Tensor) -> torch.Tensor:
        """Gather tokens into a new tensor of shape ``(num_layers, planes, n, num_kv_heads, head_dim)``.

        Args:
            indices: a 1-D int64 CPU tensor of token indices (any tokens, not necessarily whole pages).

        Raises:
            TypeError: when `indices` is not a 1-D int64 CPU tensor.
            ValueError: when an index is out of range.
        """
        pages, offsets = self._token_coords(indices, "indices")
        # Advanced indices on dims 0 and 3 are not adjacent, so the token dim comes first: (n, L, 2, H, D).
        return self.buffer[pages, :, :, offsets].permute(1, 2, 0, 3, 4).contiguous()

    def write_tokens(self, indices: torch.Tensor, kv: torch.Tensor) -> None:
        """Scatter `kv` of shape ``(num_layers, planes, n, num_kv_heads, head_dim)`` into tokens `indices`.

        Args:
            indices: a 1-D int64 CPU tensor of `n` token indices.
            kv: the values, of the pool's dtype, on any device.

        Raises:
            TypeError: when `indices` or `kv` has the wrong type or dtype.
            ValueError: when `kv` has the wrong shape or an index is out of range.
        """
        if not isinstance(kv, torch.Tensor):
            raise TypeError(f"kv: expected a tensor, got {type(kv).__name__}")
        pages, offsets = self._token_coords(indices, "indices")
        expected = self._layout.tokens_shape(indices.numel())
        if tuple(kv.shape) != expected:
            raise ValueError(f"kv: expected shape {expected}, got {tuple(kv.shape)}")
        if kv.dtype != self._layout.dtype:
            raise TypeError(f"kv: expected dtype {self._layout.dtype}, got {kv.dtype}")
        self.buffer[pages, :, :, offsets] = kv.to(self._device).permute(2, 0, 1, 3, 4)

    # -- state ----------------------------------------------------------------------------------------

    def statistics(self) -> PoolStatistics:
        """A frozen snapshot of occupancy and placement."""
        return PoolStatistics(
            name=self._name,
            device=str(self._device),
            capacity_pages=self._allocator.capacity_pages,
            free_pages=self._allocator.free_pages,
            used_pages=self._allocator.used_pages,
            page_size=self.page_size,
            page_nbytes=self._layout.page_nbytes,
            pinned=self._pinned,
        )

    def close(self) -> None:
        """Drop the buffer; idempotent. Outstanding page views keep their memory alive."""
        self._buffer = None
        self._bytes = None

    async def aclose(self) -> None:
        """Asynchronous `close`; idempotent."""
        self.close()

    def __enter__(self) -> KVPool:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    async def __aenter__(self) -> KVPool:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # `warnings.warn` is bound as a default so the check still works while the interpreter shuts down.
    def __del__(self, _warn: Callable[..., None] = warnings.warn) -> None:
        if self._buffer is not None:
            _warn(f"unclosed {self!r}", ResourceWarning, stacklevel=2, source=self)

    def _check_open(self) -> None:
        if self._buffer is None:
            raise CacheClosed(f"pool {self._name!r} is closed")

    def __repr__(self) -> str:
        a = self._allocator
        state = " closed" if self._buffer is None else ""
        return (
            f"<KVPool {self._name!r} device={self._device} pinned={self._pinned}{state} "
            f"pages={a.used_pages}/{a.capacity_pages} used page_size={self.page_size} "
            f"page_shape={self._layout.page_shape} dtype={self._layout.dtype} "
            f"page_nbytes={self._layout.page_nbytes}>"
        )


HostPool = KVPool
"""A host pool is a CPU `KVPool`; with the default `pin_memory=None` it is pinned when CUDA is available."""


def make_device_pool(layout: KVLayout, num_pages: int, *, name: str = "device") -> KVPool:
    """A pool on the first CUDA device when one is available, otherwise on the CPU (pageable).

    Args:
        layout: the shape of one page.
        num_pages: pages in the pool.
        name: the pool's label.
    """
    if torch.cuda.is_available():
        return KVPool(layout, num_pages, device="cuda", pin_memory=False, name=name)
    return KVPool(layout, num_pages, device="cpu", pin_memory=False, name=name)


def make_host_pool(layout: KVLayout, num_pages: int, *, name: str = "host") -> KVPool:
    """A CPU pool, pinned when CUDA is available (see `KVPool`'s `pin_memory=None`).

    Args:
        layout: the shape of one page.
        num_pages: pages in the pool.
        name: the pool's label.
    """
    return KVPool(layout, num_pages, device="cpu", pin_memory=None, name=name)


class PageViews(Sequence[memoryview]):
    """Zero-copy byte views of some pages of a pool's flat buffer, each built on first access and kept.

    A kept view stays the same object (stray-thread bookkeeping, `storage_backends.threads`, goes by
    `id`). A slice is a plain list of views.
    """

    __slots__ = ("_flat", "_size", "_starts", "_views")

    def __init__(self, flat: memoryview, starts: list[int], size: int) -> None:
        self._flat = flat
        self._starts = starts
        self._size = size
        self._views: list[memoryview | None] = [None] * len(starts)

    def __len__(self) -> int:
        return len(self._starts)

    @overload
    def __getitem__(self, index: int) -> memoryview: ...

    @overload
    def __getitem__(self, index: slice) -> list[memoryview]: ...

    def __getitem__(self, index: int | slice) -> memoryview | list[memoryview]:
        if isinstance(index, slice):
            return self._slice(index)
        i = operator.index(index)
        n = len(self._starts)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index: page view {index} out of range for {n} pages")
        return self._view(i)

    def __iter__(self) -> Iterator[memoryview]:
        return iter(self[:])

    def _slice(self, index: slice) -> list[memoryview]:
        """The views of a slice, those not built yet built in one pass (a stream's batch asks for
        hundreds at once: one comprehension, not a method call per page)."""
        views = self._views
        kept = views[index]
        if None not in kept:
            return kept  # type: ignore[return-value]  # no None left in it
        flat, size, starts = self._flat, self._size, self._starts[index]
        built = [
            flat[start : start + size] if view is None else view
            for view, start in zip(kept, starts, strict=True)
        ]
        views[index] = built
        return built

    def _view(self, i: int) -> memoryview:
        view = self._views[i]
        if view is None:
            start = self._starts[i]
            view = self._views[i] = self._flat[start : start + self._size]
        return view
