"""The one protocol every storage backend implements.

Backends know page keys and bytes, never tree nodes. A page key is the hex form of a page's chained hash
(see `hicache.keys.chained_page_hashes`), so it already carries the namespace. Buffers are writable,
C-contiguous `memoryview`s of exactly one page payload each, usually views of pinned host-pool pages: `get`
writes into them in place (zero-copy where the medium allows), `put` reads from them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

__all__ = ["StorageBackend"]


@runtime_checkable
class StorageBackend(Protocol):
    """A page store: batch exists/get/put/delete over page keys, closed with `aclose()`.

    Contract (checked by `tests/storage/contract.py` for every backend):
      * `exists(keys)` returns the length of the longest prefix of `keys` that is fully stored.
      * `get(keys, buffers)` fills `buffers[i]` with page `keys[i]` and returns one bool per page; a page that
        is missing, torn, truncated or fails its checksum is `False` and is never reported as loaded.
      * `put(keys, buffers)` stores each page atomically: a reader sees the whole page or none of it.
        Returns one bool per page.
      * Cancellation is honoured promptly (within a few event-loop turns, never after a stuck I/O): a
        cancelled `get` or `put` does not wait for its worker threads. Buffers and threads:
          - when a call returns normally, no I/O touches any of its buffers any more;
          - when it raises (cancelled, or failed after cancelling its siblings), a worker thread may still
            read or write some of them; each such thread is registered, with exactly the buffers it may
            touch, in `storage_backends.threads.stray_threads` until it returns, and a caller must not
            reuse a buffer while `stray_threads.busy([buffer])` is true. Backends start their worker
            threads through `storage_backends.batching.run_in_thread(..., touches=buffers)`, which does it.
        A thread that never returns keeps its buffers out of use forever: that is the price of a caller
        that is never hung.
      * `delete(keys)` removes pages; absent keys are ignored.
      * `aclose()` is idempotent; any call made after it began raises `hicache.errors.CacheClosed`, and it
        returns only once the calls already in flight have returned (`storage_backends.lifecycle`).
    """

    async def exists(self, keys: Sequence[str]) -> int:
        """Length of the longest prefix of `keys` whose pages are all stored."""
        ...

    async def get(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[bool]:
        """Read pages into caller buffers; one success flag per page."""
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
