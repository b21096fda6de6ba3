"""The one protocol every storage backend implements.

Backends know page keys and bytes, never tree nodes. A page key is the hex form of a page's chained hash
(see `hicache.keys.chained_page_hashes`), so it already carries the namespace. Buffers are writable,
C-contiguous `memoryview`s of exactly one page payload each, usually views of pinned host-pool pages: `get`
writes into them in place (zero-copy where the medium allows), `put` reads from them.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

__all__ = ["PageStatus", "StorageBackend"]


class PageStatus(enum.Enum):
    """What `get` did with one page. Truthy only for `HIT`, so `all(await backend.get(...))` means "all
    loaded"; a failure's value is the `reason` label of the controller's `storage_page_failures` metric."""

    HIT = "hit"
    """The page was read into its buffer and verified."""
    MISS = "miss"
    """No page is stored under the key."""
    CORRUPT = "corrupt"
    """The stored page is truncated, overlong, has a bad header, or fails its checksum."""
    FOREIGN = "foreign_page"
    """The stored page verifies but its header names another namespace or another key: a page copied,
    renamed or symlinked over this key, or written by a differently configured cache."""
    OLD_FORMAT = "old_format"
    """The stored page was written in a page format version this reader does not read (version 1)."""
    ERROR = "error"
    """The read failed for another reason (permissions, an I/O error, an unreachable server)."""

    def __bool__(self) -> bool:
        return self is PageStatus.HIT


@runtime_checkable
class StorageBackend(Protocol):
    """A page store: batch exists/get/put/delete over page keys, closed with `aclose()`.

    Contract (checked by `tests/storage/contract.py` for every backend):
      * `exists(keys)` returns the length of the longest prefix of `keys` that is fully stored.
      * `get(keys, buffers)` fills `buffers[i]` with page `keys[i]` and returns one `PageStatus` per page;
        only a page whose header names this backend's namespace and `keys[i]` and whose checksum verifies
        is `HIT`. Anything else is never reported as loaded (its buffer's contents are then unspecified):
        `MISS`, `CORRUPT`, `FOREIGN`, `OLD_FORMAT` or `ERROR`, saying why.
      * `put(keys, buffers)` stores each page atomically: a reader sees the whole page or none of it.
        Returns one bool per page.
      * Cancellation is honoured promptly (within a few event-loop turns, never after a stuck I/O): a
        cancelled `get` or `put` does not wait for its worker threads. Buffers and threads:
          - when a call returns normally, no I/O touches any of its buffers any more;
          - when it raises (cancelled, or failed), a worker thread may still read or write some of them;
            each such thread is registered, with exactly the buffers it may touch, in
            `storage_backends.threads.stray_threads` until it returns, and a caller must not reuse a
            buffer while `stray_threads.busy([buffer])` is true; every other buffer is quiet.
        Backends run every blocking call in their own `storage_backends.threads.WorkerThreads` (at most
        `max_concurrency` threads), passing the buffers each job touches: a job not started when its
        caller is cancelled never starts, one already running is registered as above until it returns.
        A thread that never returns keeps its buffers out of use forever: that is the price of a caller
        that is never hung.
      * `delete(keys)` removes pages; absent keys are ignored.
      * `aclose()` is idempotent; any call made after it began raises `storage_backends.errors.CacheClosed`,
        and it returns only once the calls already in flight have returned (`storage_backends.lifecycle`).
    """

    async def exists(self, keys: Sequence[str]) -> int:
        """Length of the longest prefix of `keys` whose pages are all stored."""
        ...

    async def get(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[PageStatus]:
        """Read pages into caller buffers; one `PageStatus` per page (`HIT` when loaded and verified)."""
        ...

    async def put(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[bool]:
        """Write pages from caller buffers atomically; one success flag per page."""
        ...

    async def delete(self, keys: Sequence[str]) -> None:
        """Remove pages; absent keys are ignored."""
        ...

    async def aclose(self) -> None:
        """Release the backend's resources; idempotent."""
        ...
