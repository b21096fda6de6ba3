"""The errors storage backends raise, and the root of hicache's whole exception hierarchy.

This module is a leaf (it imports nothing of `hicache`'s or of any other module of this package), so the
storage layer depends on nothing above it. `hicache.errors` re-exports every class here as the same
object and adds the cache's own errors under the same root: `except hicache.errors.StorageError` and
`except storage_backends.errors.StorageError` catch the same thing.
"""

from __future__ import annotations

__all__ = [
    "CacheClosed",
    "ChecksumMismatch",
    "ForeignPage",
    "HiCacheError",
    "OldPageFormat",
    "PageNotFound",
    "StorageAuthError",
    "StorageError",
    "StorageUnavailable",
]


class HiCacheError(Exception):
    """Base class of every error hicache raises on purpose."""


class CacheClosed(HiCacheError, RuntimeError):
    """Raised when an operation is started on a cache, controller or backend that was already closed."""


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
