"""An in-process storage backend: stored pages (header + payload) kept as `bytes` in a dict.

It runs the same page format and verification as the file backend, so the contract suite's corruption
tests apply to it, and it is the backend of choice for tests and demos. `memory://name` URLs share one
process-wide store per name, so two backends (or a writer and a later reader) see the same pages;
`memory://` alone gives a private store.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from storage_backends.batching import (
    HIT,
    MISS,
    BackendStatistics,
    StatisticsRecorder,
    check_batch,
    gather_page_groups,
)
from storage_backends.errors import ChecksumMismatch
from storage_backends.lifecycle import BackendLifecycle
from storage_backends.page_format import (
    HEADER_SIZE,
    check_namespace_digest,
    check_stored_size,
    encode_header,
    failure_status,
    validate_keys,
    verify_page,
)
from storage_backends.protocol import PageStatus
from storage_backends.redact import redact_url
from storage_backends.threads import WorkerThreads

__all__ = ["MemoryBackend", "drop_named_store"]

log = logging.getLogger(__name__)

_GROUP_BYTES = 1 << 20
_named_stores: dict[str, dict[str, bytes]] = {}
_named_lock = threading.Lock()


def drop_named_store(name: str) -> bool:
    """Forget the process-wide store `memory://name`; return whether it existed.

    Backends still open on it keep their pages; the next backend opened on `name` starts empty.
    """
    with _named_lock:
        return _named_stores.pop(name, None) is not None


class MemoryBackend(BackendLifecycle):
    """Pages in a Python dict, verified on every read exactly like stored files.

    Args:
        namespace_digest: the 16-byte namespace digest written into, and required from, every page.
        name: share the process-wide store of this name (what `memory://name` opens); `None` for a
            private store.
        max_concurrency: the most worker threads copying and hashing pages at once.

    Raises:
        ValueError: for a bad `namespace_digest` or `max_concurrency` < 1.
    """

    def __init__(self, *, namespace_digest: bytes, name: str | None = None, max_concurrency: int = 4) -> None:
        self._closed = True  # until fully constructed: a failed __init__ must not warn in __del__
        self._namespace = check_namespace_digest(namespace_digest)
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency: expected >= 1, got {max_concurrency}")
        self._name = name
        if name is None:
            self._pages: dict[str, bytes] = {}
        else:
            with _named_lock:
                self._pages = _named_stores.setdefault(name, {})
        self._max_concurrency = max_concurrency
        self._workers = WorkerThreads(max_concurrency, name="hicache-memory")
        self._stats = StatisticsRecorder()
        self._closed = False

    @classmethod
    def from_url(cls, url: str, *, namespace_digest: bytes, **options: Any) -> MemoryBackend:
        """Open a backend from `memory://name` (shared store) or `memory://` (private store).

        Raises:
            ValueError: naming `url`, for another scheme or a path after the name.
        """
        parts = urlsplit(url)
        if parts.scheme != "memory":
            raise ValueError(f"url: expected a memory:// URL, got {redact_url(url)!r}")
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise ValueError(
                f"url: expected memory://name with nothing after the name, got {redact_url(url)!r}"
            )
        return cls(namespace_digest=namespace_digest, name=parts.netloc or None, **options)

    def statistics(self) -> BackendStatistics:
        """Counters since the backend was opened."""
        return self._stats.snapshot()

    def corrupt(self, key: str, *, offset: int = -1, truncate: int | None = None) -> None:
        """Damage a stored page for tests: flip the byte at `offset` or cut it to `truncate` bytes.

        Raises:
            KeyError: if the page is not stored.
        """
        data = bytearray(self._pages[key])
        if truncate is not None:
            del data[truncate:]
        else:
            data[offset] ^= 0xFF
        self._pages[key] = bytes(data)

    # -- the protocol ---------------------------------------------------------------------------------

    async def exists(self, keys: Sequence[str]) -> int:
        """Length of the longest prefix of `keys` whose pages are all stored."""
        validate_keys(keys)
        pages = self._pages
        for i, key in enumerate(keys):
            if key not in pages:
                return i
        return len(keys)

    async def get(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[PageStatus]:
        """Copy pages into `buffers` and verify them (in worker threads); one `PageStatus` per page.

        Raises:
            CacheClosed: after `aclose()`.
            ValueError: naming `keys` or `buffers`, as `FileBackend.get`.
        """
        check_batch(keys, buffers)
        validate_keys(keys)
        outcomes = await gather_page_groups(
            self._read_group,
            keys,
            buffers,
            workers=self._workers,
            group_bytes=_GROUP_BYTES,
        )
        return self._stats.record_reads(outcomes, buffers)

    async def put(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[bool]:
        """Store pages (header + a copy of the payload), each replacing any older version whole.

        Raises:
            CacheClosed: after `aclose()`.
            ValueError: naming `keys` or `buffers`, as `FileBackend.put`.
        """
        check_batch(keys, buffers)
        validate_keys(keys)
        outcomes = await gather_page_groups(
            self._write_group,
            keys,
            buffers,
            workers=self._workers,
            group_bytes=_GROUP_BYTES,
        )
        return self._stats.record_writes(outcomes, buffers)

    async def delete(self, keys: Sequence[str]) -> None:
        """Remove pages; absent keys are ignored."""
        validate_keys(keys)
        for key in keys:
            self._pages.pop(key, None)

    def _release(self) -> None:
        """Let go of the pages (a private store's are freed, a named store keeps them for later backends)
        and the worker threads."""
        self._pages = {}
        self._workers.close()

    def __repr__(self) -> str:
        s = self._stats
        state = "closed" if self._closed else "open"
        store = f"memory://{self._name}" if self._name is not None else "private"
        return (
            f"<MemoryBackend {state} store={store} pages={len(self._pages)} "
            f"namespace={self._namespace.hex()[:8]}… read={s.pages_read} written={s.pages_written} "
            f"misses={s.misses} checksum_failures={s.checksum_failures} foreign={s.foreign_pages} "
            f"old_format={s.old_format_pages} errors={s.errors}>"
        )

    # -- internals ------------------------------------------------------------------------------------

    def _read_group(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[PageStatus]:
        return [self._read_one(key, buf) for key, buf in zip(keys, buffers, strict=True)]

    def _read_one(self, key: str, buf: memoryview) -> PageStatus:
        data = self._pages.get(key)
        if data is None:
            return MISS
        stored = memoryview(data)
        try:
            if len(data) != HEADER_SIZE + buf.nbytes:
                check_stored_size(stored[:HEADER_SIZE], len(data), buf.nbytes, self._namespace, key)
            payload = stored[HEADER_SIZE:]
            verify_page(stored[:HEADER_SIZE], payload, self._namespace, key)
        except ChecksumMismatch as exc:
            log.warning("discarding page %s: %s", key, exc)
            return failure_status(exc)
        # Copy only verified bytes: a bad page leaves the buffer untouched.
        target = buf if buf.format == "B" and buf.ndim == 1 else buf.cast("B")
        target[:] = payload
        return HIT

    def _write_group(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[PageStatus]:
        pages = self._pages
        for key, buf in zip(keys, buffers, strict=True):
            pages[key] = encode_header(buf, self._namespace, key) + buf
        return [HIT] * len(keys)
