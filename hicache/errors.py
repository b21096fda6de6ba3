"""The exception hierarchy of hicache: every error the library raises on purpose derives from `HiCacheError`."""

from __future__ import annotations

__all__ = [
    "CacheClosed",
    "ChecksumMismatch",
    "ForeignPage",
    "HiCacheError",
    "InvariantViolation",
    "LeaseReleased",
    "LoadBackFailed",
    "OldPageFormat",
    "PageNotFound",
    "PoolError",
    "StorageAuthError",
    "StorageCircuitOpen",
    "StorageError",
    "StorageUnavailable",
    "UnknownRequest",
    "UnsupportedEventLoop",
]


class HiCacheError(Exception):
    """Base class of every error hicache raises on purpose."""


class InvariantViolation(HiCacheError, AssertionError):
    """Raised by `sanity_check()` with every violated invariant of the tree listed, one per line."""

    def __init__(self, violations: list[str]) -> None:
        self.violations = list(violations)
        lines = "\n".join(f"  - {v}" for v in self.violations)
        super().__init__(f"{len(self.violations)} invariant violation(s):\n{lines}")


class PoolError(HiCacheError, ValueError):
    """Raised when indices handed back to a pool are foreign, misaligned or already free (a double free)."""


class CacheClosed(HiCacheError, RuntimeError):
    """Raised when an operation is started on a cache, controller or backend that was already closed."""


class LoadBackFailed(HiCacheError, RuntimeError):
    """Raised by `LayerReadiness.wait_layer` when a layer-wise load-back's copy failed before that layer
    landed (the model must not read it)."""


class LeaseReleased(HiCacheError, ValueError):
    """Raised when a released lease is used: inserted, or its `layers` waited on (its pages may hold another
    request's KV by then)."""


class UnsupportedEventLoop(HiCacheError, RuntimeError):
    """Raised when a cache is started outside an asyncio event loop (anyio on trio, or no loop at all): the
    read threads' eventfd, the loop pacer and the background workers are asyncio's."""


class UnknownRequest(HiCacheError, KeyError):
    """Raised when a prefetch request id is unknown: never started, already committed or already cancelled."""


class StorageError(HiCacheError, OSError):
    """Base class of storage backend errors; backends translate their native errors into these."""


class PageNotFound(StorageError, FileNotFoundError):
    """Raised when a page is absent from storage."""


class ChecksumMismatch(StorageError):
    """Raised when a stored page's header or checksum does not verify: the page is treated as a miss."""


class ForeignPage(ChecksumMismatch):
    """Raised when a stored page's header names another namespace or another key than the one it was read
    under (a page copied, renamed or symlinked over this key, or written by another cache): a miss."""


class OldPageFormat(ChecksumMismatch):
    """Raised when a stored page was written in a page format version this reader does not read (a
    version 1 page, from before pages carried their key): a miss."""


class StorageUnavailable(StorageError, ConnectionError):
    """Raised when the storage service cannot be reached after retries within the deadline."""


class StorageAuthError(StorageError, PermissionError):
    """Raised when the storage service refuses our credentials or permissions (HTTP 401/403): an outage
    for this cache as much as a dead endpoint, not a miss."""


class StorageCircuitOpen(StorageUnavailable):
    """Raised without any I/O when a storage tier's circuit breaker is open: storage was found down and
    the next probe of it is not due yet (see `hicache.controller.breaker`)."""
