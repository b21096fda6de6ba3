"""A page allocator handing out token-granular indices in whole, aligned pages.

Indices are int64 CPU tensors of token slots: page ``p`` covers tokens ``[p * P, p * P + P)`` where ``P`` is
the page size. Allocation and freeing cost O(1) per page: free pages live on a stack, and a ``bytearray`` of
per-page owner tags (viewed as a tensor, so checks are vectorised) says who holds each page: free, the
caller (a lease), the tree, an in-flight copy, a prefetch or the release queue. The tags detect double
frees, and let the cache refuse a caller's index that is not the caller's to give.
"""

from __future__ import annotations

import enum

import numpy as np
import numpy.typing as npt
import torch

from hicache.errors import PoolError
from hicache.tree.node import page_runs

__all__ = ["Owner", "PageAllocator", "check_token_indices"]


class Owner(enum.IntEnum):
    """Who holds a page of a pool (one tag per page, kept by the `PageAllocator`)."""

    FREE = 0
    """Not allocated."""
    LEASE = 1
    """Handed to the caller (`alloc_device`, `alloc_component`, a plain `alloc`) and not inserted yet."""
    TREE = 2
    """Held by a tree node (or queued by the tree for freeing)."""
    COPY = 3
    """The destination of a copy in flight: a load-back's device pages, a backup's host pages."""
    PREFETCH = 4
    """Host buffers of a storage prefetch in flight."""
    RELEASE = 5
    """Handed to the release queue, freed once no I/O can write into them."""


_FREE = Owner.FREE
_HELD_BY = {
    Owner.FREE: "free (never allocated, or already freed)",
    Owner.LEASE: "held by the caller (allocated, not inserted)",
    Owner.TREE: "held by the tree",
    Owner.COPY: "the destination of a copy in flight",
    Owner.PREFETCH: "buffers of a prefetch in flight",
    Owner.RELEASE: "pending release",
}


def check_token_indices(indices: object, *, name: str = "indices") -> torch.Tensor:
    """Check that `indices` is a 1-D int64 CPU tensor and return it.

    Args:
        indices: the value to check.
        name: the argument name used in error messages.

    Raises:
        TypeError: when `indices` is not a tensor, not int64, not 1-D or not on the CPU.
    """
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"{name}: expected a 1-D int64 CPU tensor, got {type(indices).__name__}")
    if indices.dtype != torch.int64:
        raise TypeError(f"{name}: expected dtype torch.int64, got {indices.dtype}")
    if indices.dim() != 1:
        raise TypeError(f"{name}: expected a 1-D tensor, got shape {tuple(indices.shape)}")
    if indices.device.type != "cpu":
        raise TypeError(f"{name}: expected a CPU tensor, got device {indices.device}")
    return indices


def _repeats(pages: npt.NDArray[np.int64]) -> bool:
    """Whether a page id appears more than once."""
    if pages.size < 2:
        return False
    if (pages[1:] > pages[:-1]).all():  # ascending, as fresh allocations are: no repeat, no sort
        return False
    ordered = np.sort(pages)
    return bool((ordered[1:] == ordered[:-1]).any())


class PageAllocator:
    """Hands out and takes back whole pages as token-granular index tensors.

    Args:
        num_pages: how many pages the allocator manages (at least 0).
        page_size: tokens per page (at least 1).

    Raises:
        ValueError: when `num_pages` or `page_size` is out of range.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 0:
            raise ValueError(f"num_pages: expected an int >= 0, got {num_pages!r}")
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size: expected an int >= 1, got {page_size!r}")
        self._num_pages = num_pages
        self._page_size = page_size
        # Popped from the end, so page 0 is handed out first and fresh allocations are ascending runs.
        self._free_stack: list[int] = list(range(num_pages - 1, -1, -1))
        self._state = bytearray(num_pages)  # one `Owner` tag per page, all FREE
        self._state_view = (
            torch.frombuffer(self._state, dtype=torch.uint8)
            if num_pages
            else torch.empty(0, dtype=torch.uint8)
        )
        self._offsets = torch.arange(page_size, dtype=torch.int64)
        # The same tags and offsets as numpy arrays: checks of a few pages cost a microsecond or two in
        # numpy where each small torch op costs several (validation runs on every insert and free).
        self._tags: npt.NDArray[np.uint8] = np.frombuffer(self._state, dtype=np.uint8)
        self._offsets_np = np.arange(page_size, dtype=np.int64)

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return self._page_size

    @property
    def capacity_pages(self) -> int:
        """Pages managed in total."""
        return self._num_pages

    @property
    def capacity_tokens(self) -> int:
        """Token slots managed in total."""
        return self._num_pages * self._page_size

    @property
    def free_pages(self) -> int:
        """Pages currently free."""
        return len(self._free_stack)

    @property
    def used_pages(self) -> int:
        """Pages currently handed out."""
        return self._num_pages - len(self._free_stack)

    def alloc(self, num_tokens: int, owner: Owner = Owner.LEASE) -> torch.Tensor | None:
        """Allocate `num_tokens` token slots in whole pages.

        Args:
            num_tokens: a multiple of the page size, at least 0.
            owner: the tag the new pages get (default: held by the caller).

        Returns:
            A 1-D int64 tensor of `num_tokens` token indices made of aligned page runs, or `None` when not
            enough pages are free (nothing is allocated then).

        Raises:
            ValueError: when `num_tokens` is negative or not a multiple of the page size, or `owner` is FREE.
        """
        if owner is Owner.FREE:
            raise ValueError("owner: a page handed out cannot be tagged FREE")
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int):
            raise ValueError(f"num_tokens: expected an int, got {type(num_tokens).__name__}")
        if num_tokens < 0 or num_tokens % self._page_size:
            raise ValueError(
                f"num_tokens: expected a non-negative multiple of page_size={self._page_size}, "
                f"got {num_tokens}"
            )
        n_pages = num_tokens // self._page_size
        if n_pages > len(self._free_stack):
            return None
        if n_pages == 0:
            return torch.empty(0, dtype=torch.int64)
        pages = self._free_stack[-n_pages:]
        del self._free_stack[-n_pages:]
        pages.reverse()
        page_a = np.array(pages, dtype=np.int64)
        self._tags[page_a] = int(owner)
        return torch.from_numpy((page_a[:, None] * self._page_size + self._offsets_np).reshape(-1))

    def free(self, indices: torch.Tensor, owner: Owner = Owner.LEASE) -> None:
        """Give back token indices previously returned by `alloc` (any whole pages of them).

        Everything is validated before anything is freed: on error the allocator is unchanged.

        Args:
            indices: a 1-D int64 CPU tensor of whole, aligned page runs.
            owner: the tag every page must carry (default: held by the caller); the tree, a copy, a
                prefetch and the release queue free their own pages by naming themselves.

        Raises:
            TypeError: when `indices` is not a 1-D int64 CPU tensor.
            PoolError: when `indices` is misaligned, foreign (out of range), repeats a page, or names a page
                that is already free (a double free) or held by another owner than `owner`.
        """
        pages = self._pages(indices, "indices")
        if pages.size == 0:
            return
        if _repeats(pages):
            raise PoolError("indices: the same page appears more than once (a double free)")
        tags = self._tags[pages]
        already_free = tags == int(_FREE)
        if already_free.any():
            bad = pages[already_free][:8].tolist()
            raise PoolError(f"indices: double free of page(s) {bad} (already free)")
        wrong = tags != int(owner)
        if wrong.any():
            bad = pages[wrong][:8].tolist()
            held = sorted({_HELD_BY[Owner(int(t))] for t in tags[wrong][:8].tolist()})
            raise PoolError(f"indices: page(s) {bad} are not {_HELD_BY[owner]}; they are {'; '.join(held)}")
        self._tags[pages] = int(_FREE)
        self._free_stack.extend(reversed(pages.tolist()))

    def page_ids(self, indices: torch.Tensor, *, name: str = "indices") -> torch.Tensor:
        """Turn token indices of whole, aligned pages into page ids, validating them.

        Args:
            indices: a 1-D int64 CPU tensor whose length is a multiple of the page size, made of runs
                ``[p * P, p * P + P)``.
            name: the argument name used in error messages.

        Returns:
            A 1-D int64 tensor of page ids, one per page, in order.

        Raises:
            TypeError: when `indices` is not a 1-D int64 CPU tensor.
            PoolError: when `indices` is misaligned or out of range (foreign).
        """
        return torch.from_numpy(self._pages(indices, name))

    def _pages(self, indices: object, name: str) -> npt.NDArray[np.int64]:
        """`page_ids` as a numpy array (see there); `indices` may also be a 1-D int64 numpy array."""
        if isinstance(indices, np.ndarray):
            if indices.dtype != np.int64 or indices.ndim != 1:
                raise TypeError(f"{name}: expected a 1-D int64 array, got {indices.dtype} {indices.shape}")
            tokens: npt.NDArray[np.int64] = indices
        else:
            tokens = check_token_indices(indices, name=name).numpy()
        size = self._page_size
        n = tokens.size
        if not tokens.flags.c_contiguous:  # a strided view (a tensor's slice)
            tokens = np.ascontiguousarray(tokens)
        pages: npt.NDArray[np.int64] = np.empty(n // size, dtype=np.int64)
        # Whole runs [p * P, p * P + P) of pages in range, in one pass in C.
        code = page_runs(tokens, pages, size, self._num_pages)
        if code == 1:
            raise PoolError(f"{name}: length {n} is not a multiple of page_size={size}")
        if code == 2:
            raise PoolError(f"{name}: not made of page-aligned runs of {size} consecutive token indices")
        if code == 3:
            raise PoolError(
                f"{name}: indices outside this pool's {self.capacity_tokens} token slots (foreign indices)"
            )
        return pages

    def pages_to_tokens(self, pages: torch.Tensor) -> torch.Tensor:
        """Expand page ids into the token indices they cover (no validation).

        Args:
            pages: a 1-D int64 tensor of page ids.

        Returns:
            A 1-D int64 tensor of ``len(pages) * page_size`` token indices.
        """
        return (pages[:, None] * self._page_size + self._offsets).reshape(-1)

    def is_free(self, page_id: int) -> bool:
        """Whether page `page_id` is currently free."""
        return self.owner_of(page_id) is Owner.FREE

    def owner_of(self, page_id: int) -> Owner:
        """Who holds page `page_id`."""
        if not 0 <= page_id < self._num_pages:
            raise ValueError(f"page_id: expected 0 <= page_id < {self._num_pages}, got {page_id}")
        return Owner(self._state[page_id])

    def owner_tags(self) -> torch.Tensor:
        """A copy of every page's `Owner` tag, as a uint8 tensor indexed by page id."""
        return self._state_view.clone()

    def set_owner(self, indices: torch.Tensor | npt.NDArray[np.int64], owner: Owner) -> None:
        """Re-tag allocated pages of the token indices `indices`: runs of whole, aligned pages, as every
        allocation is (internal, not validated; a trailing partial run re-tags its whole page).

        Only each run's first token is read: a 1,024-page prefetch re-tags 1,024 entries, not 65,536.
        """
        if owner is Owner.FREE:
            raise ValueError("owner: use `free` to give pages back")
        tokens = indices if isinstance(indices, np.ndarray) else indices.numpy()
        if tokens.size:
            size = self._page_size
            self._tags[tokens[::size] // size] = int(owner)

    def check_owned(self, indices: object, owner: Owner, *, name: str = "indices") -> torch.Tensor:
        """Validate that `indices` are whole, distinct pages all tagged `owner`; return their page ids.

        Nothing changes: this only reads the tags.

        Args:
            indices: a 1-D int64 CPU tensor (or numpy array) of token indices made of whole, aligned pages.
            owner: the tag every page must carry.
            name: the argument name used in error messages.

        Raises:
            TypeError: when `indices` is not a 1-D int64 CPU tensor.
            PoolError: when `indices` is misaligned, out of range, repeats a page, or names a page not
                tagged `owner` (free, or held by someone else).
        """
        pages = self._pages(indices, name)
        if _repeats(pages):
            raise PoolError(f"{name}: the same page appears more than once")
        tags = self._tags[pages]
        wrong = tags != int(owner)
        if wrong.any():
            bad = pages[wrong][:8].tolist()
            held = sorted({_HELD_BY[Owner(int(t))] for t in tags[wrong][:8].tolist()})
            raise PoolError(f"{name}: page(s) {bad} are not {_HELD_BY[owner]}; they are {'; '.join(held)}")
        return torch.from_numpy(pages)

    def __repr__(self) -> str:
        return f"<PageAllocator pages={self.used_pages}/{self._num_pages} used, page_size={self._page_size}>"
