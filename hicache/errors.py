"""The exception hierarchy of hicache: every error the library raises on purpose derives from `HiCacheError`.

The root and the storage errors live in the leaf `storage_backends.errors` (the storage layer imports
nothing of hicache) and are re-exported here as the same class objects; the cache's own errors follow.
"""

from __future__ import annotations

from storage_backends.errors import (
    CacheClosed,
    ChecksumMismatch,
    ForeignPage,
    HiCacheError,
    OldPageFormat,
    PageNotFound,
    StorageAuthError,
    StorageError,
    StorageUnavailable,
)

__all__ = [
    "CacheClosed",
    "CacheFailed",
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


class InvariantViolation(HiCacheError, AssertionError):
    """Raised by `sanity_check()` with every violated invariant of the tree listed, one per line."""

    def __init__(self, violations: list[str]) -> None:
        self.violations = list(violations)
        lines = "\n".join(f"  - {v}" for v in self.violations)
        super().__init__(f"{len(self.violations)} invariant violation(s):\n{lines}")


class PoolError(HiCacheError, ValueError):
    """Raised when indices handed back to a pool are foreign, misaligned or already free (a double free)."""


class CacheFailed(CacheClosed):
    """Raised by every call on a cache whose background work (the release queue, a backup, a storage write
    or a prefetch stream) raised an unexpected exception: the cache logged it once, released what it
    could and closed; the job's exception is the `__cause__`. `aclose()` still finishes."""


class LoadBackFailed(HiCacheError, RuntimeError):
    """Raised by `LayerReadiness.wait_layer` when a layer-wise load-back's copy failed before that layer
    landed (the model must not read it)."""


class LeaseReleased(HiCacheError, ValueError):
    """Raised when a released lease is used: inserted, or its `layers` waited on (its pages may hold another
    request's KV by then)."""


class UnsupportedEventLoop(HiCacheError, RuntimeError):
    """Raised when a cache is started outside an asyncio event loop (anyio on trio, or no loop at all): the
    read threads' eventfd, the loop pacer and the background workers are asyncio's; and when a started
    cache is used from another event loop than the one that started it (its workers never run there)."""


class UnknownRequest(HiCacheError, KeyError):
    """Raised when a prefetch request id is unknown: never started, already committed or already cancelled."""


class StorageCircuitOpen(StorageUnavailable):
    """Raised without any I/O when a storage tier's circuit breaker is open: storage was found down and
    the next probe of it is not due yet (see `hicache.controller.storage.guarded`)."""
