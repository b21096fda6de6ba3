"""A storage backend on a local or mounted filesystem: a group file per put, a hard link per page.

Layout: each page is named `root/ab/<key>.kvp`, where `ab` is the key's first hex pair: 256 directories,
created once, each holding 1/256 of the names (directories are hashed indexes on ext4 and XFS). A name is a
hard link to the group file its put wrote (`storage_backends.file_pages`, docs/storage.md): the page's
`page_format` header and payload among the group's, then a table saying where each page lies. One inode per
page was the whole kernel cost of a write (BENCHMARKS.md, issue 25); hard links need a filesystem that has
them (ext4, XFS, NFS; not some FUSE object stores). A second level (`root/ab/cd/`, 65,536 directories) cost a fresh store one
`mkdir` per page written, as much kernel CPU again as the page's own file (docs/storage.md).

`FileBackend` is the async face (validation, grouping into worker-thread jobs, statistics, lifecycle);
`storage_backends.file_pages.PageFiles` does the work on the files. Every blocking call runs in the backend's
one pool of at most `max_concurrency` threads (`storage_backends.threads.WorkerThreads`). Reads go straight
into the caller's buffer and are verified in the same pass, a whole group per job, by the C extension without
the GIL; a group is written whole to a temporary file before its first page gets its name, so a reader sees
a whole page or no page.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from storage_backends import native
from storage_backends.batching import (
    BackendStatistics,
    StatisticsRecorder,
    buffer_sizes,
    check_batch,
    gather_page_groups,
    group_slices,
)
from storage_backends.file_pages import READ_AHEAD, SUFFIX, PageFiles
from storage_backends.lifecycle import BackendLifecycle
from storage_backends.names import file_root_from_url_path
from storage_backends.page_format import check_namespace_digest, validate_key, validate_keys
from storage_backends.protocol import PageStatus
from storage_backends.redact import redact_url
from storage_backends.threads import ReadHook, ReadStatistics, WorkerThreads

__all__ = ["SUFFIX", "FileBackend", "default_concurrency"]

_GROUP_BYTES = 16 << 20
"""Target payload bytes per worker-thread call (a call of fewer bytes than the threads could share is split
further, see `group_slices`). Measured with `bench/bench_io.py` (2 cores, hot cache): 1 MiB groups reached
~0.63 of raw preadv at 1 MiB pages and ~0.66 at 64 KiB; 4 MiB groups ~1.0 and ~0.76. With the controller's
64 MiB calls, 16 MiB groups cost its loop the least CPU (14-15 ms per GiB against 16-18 ms with 4 MiB) and
a cold group advises the disk of up to 16 pages ahead instead of 4. A group abandoned by a cancelled get
keeps its buffers quarantined until its thread finishes it (at most one group's read)."""

_MIN_GROUP_BYTES = 1 << 20
"""The fewest payload bytes worth a worker-thread call of their own when a batch is spread over threads.
A thread hop costs the event loop ~50 us; with one hop per page, the controller's 8-page prefetch batches of
64 KiB pages ran at ~0.2 of raw preadv (measured with `bench/bench_io.py`)."""

_EXISTS_CHUNK = 32
"""Keys stat-ed per worker-thread call in `exists`."""


def default_concurrency() -> int:
    """Worker threads a `FileBackend` uses by default: one per usable CPU, at least 4 and at most 16.

    More threads than cores buys nothing on a hot page cache (reads are memory copies) but makes every
    thread, and the event loop, wait longer for the GIL: on 2 cores, 16 threads stalled the loop for
    15-20 ms where 4 stalled it for under 10 (`bench/bench_io.py`). Cold reads get their queue depth
    from `readahead` instead of from threads.
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return min(16, max(4, cpus))


class FileBackend(BackendLifecycle):
    """Pages as files under a root directory (a local disk, NFS, or a FUSE mount such as JuiceFS).

    Safe to share a root between processes: a page is named only once its group file is complete, and every
    read is verified.

    Args:
        root: the directory holding the pages; created if missing. A filesystem path, made absolute and
            normalised (`os.path.abspath`: `..` is resolved); `from_url` refuses `.` and `..` instead.
        namespace_digest: the 16-byte namespace digest written into, and required from, every page.
        max_concurrency: the most worker threads this backend keeps busy at once, across all its calls
            (default: `default_concurrency()`); a thread stuck in a call whose caller was cancelled gets
            a spare meanwhile (see `storage_backends.threads`).
        durable: fsync each group file before naming its pages, and their directories after.
        group_bytes: payload bytes one worker-thread call handles; small pages are grouped up to this
            size so a thread hop is shared by several pages.
        readahead: when a page of a group is not in the page cache, read the rest of the group ahead:
            the next pages are kept open and advised (`posix_fadvise(WILLNEED)`) ahead of the one being
            read, so cold reads reach the device together; pages in the page cache are read as usual.
            Needs Linux (`RWF_NOWAIT`); ignored elsewhere.

    Raises:
        ValueError: for a bad `namespace_digest`, `max_concurrency` < 1 or `group_bytes` < 1.
    """

    def __init__(
        self,
        root: str | Path,
        *,
        namespace_digest: bytes,
        max_concurrency: int | None = None,
        durable: bool = False,
        group_bytes: int = _GROUP_BYTES,
        readahead: bool = True,
    ) -> None:
        self._closed = True  # until fully constructed: a failed __init__ must not warn in __del__
        self._namespace = check_namespace_digest(namespace_digest)
        if max_concurrency is None:
            max_concurrency = default_concurrency()
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency: expected >= 1, got {max_concurrency}")
        if group_bytes < 1:
            raise ValueError(f"group_bytes: expected >= 1, got {group_bytes}")
        self._group_bytes = group_bytes
        self._root = os.path.abspath(os.fspath(root))
        os.makedirs(self._root, exist_ok=True)
        self._max_concurrency = max_concurrency
        self._durable = durable
        self._files = PageFiles(
            self._root, self._namespace, durable=durable, read_flags=READ_AHEAD if readahead else 0
        )
        self._stats = StatisticsRecorder()
        self._workers = WorkerThreads(max_concurrency, name="hicache-file")
        self._before_read: ReadHook | None = None
        """Called in the read thread with a group's keys before it is read (tests: a hung mount)."""
        self._closed = False

    @classmethod
    def from_url(cls, url: str, *, namespace_digest: bytes, **options: Any) -> FileBackend:
        """Open a backend from a `file:///absolute/path` URL; `options` go to the constructor.

        The path is percent-decoded once and must be absolute. A `.` or `..` segment, a backslash, a
        control character, an encoded `/` (`%2F`) or a `%` left after decoding is refused, never
        resolved; repeated and trailing slashes are collapsed (`storage_backends.names`).

        Raises:
            ValueError: naming `url`, for another scheme, a host part, a query or fragment, or a path
                refused as above.
        """
        if not isinstance(url, str):
            raise TypeError(f"url: expected str, got {type(url).__name__}")
        parts = urlsplit(url)
        if parts.scheme != "file":
            raise ValueError(f"url: expected a file:// URL, got {redact_url(url)!r}")
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"url: file URLs must not name a host, got {redact_url(url)!r}")
        if parts.query or parts.fragment:
            raise ValueError(f"url: file URLs take no query or fragment, got {redact_url(url)!r}")
        path = file_root_from_url_path(parts.path, argument="url")
        return cls(path, namespace_digest=namespace_digest, **options)

    @property
    def root(self) -> Path:
        """The directory holding the pages."""
        return Path(self._root)

    def path_of(self, key: str) -> Path:
        """The name of page `key`: a hard link to the group file holding it (validated: it never leaves the
        root). Its bytes are the group's; `page_extent` says which are the page's.

        Raises:
            ValueError: naming `key`, if it is not 4-128 lowercase hex characters.
        """
        validate_key(key)
        return Path(self._path(key))

    def page_extent(self, key: str) -> tuple[Path, int, int]:
        """Where page `key`'s bytes lie: the file (`path_of`), and the offset and length of its header and
        payload in it. For tests and tools that damage or inspect one page; blocking file I/O, never on the
        event loop of a serving cache.

        Raises:
            ValueError: naming `key`, for a malformed key.
            FileNotFoundError: if the page is not stored.
            ChecksumMismatch: if its group's table is torn or does not name `key`.
        """
        validate_key(key)
        path, offset, length = self._files.extent(key)
        return Path(path), offset, length

    def statistics(self) -> BackendStatistics:
        """Counters since the backend was opened."""
        return self._stats.snapshot()

    def read_statistics(self) -> ReadStatistics:
        """What the worker threads read since the backend was opened: groups read, and the seconds spent
        reading them and waiting for a thread (`bench/bench_io.py` reports groups read at once)."""
        return self._workers.statistics()

    # -- the protocol ---------------------------------------------------------------------------------

    async def exists(self, keys: Sequence[str]) -> int:
        """Length of the longest prefix of `keys` whose page files all exist (stops at the first miss).

        Keys are stat-ed in chunks by the worker threads (`storage_backends.threads`), a wave of up to
        `max_concurrency` chunks at once; a wave runs only if every page before it exists. A path holding
        no regular file (a directory, FIFO, socket or device, symlinks followed) is no page: absent, logged,
        and replaced by the next `put`.

        Raises:
            CacheClosed: after `aclose()`.
            ValueError: naming `keys`, for a malformed key.
            StorageAuthError: a page's path could not be stat-ed for want of permission (EACCES, EPERM).
            StorageError: it could not be stat-ed for another reason (ELOOP, ENOTDIR, EIO); counted in
                `statistics().errors`, never taken for a miss.
        """
        self._check_open()
        validate_keys(keys)
        n = len(keys)
        pos = 0
        wave = _EXISTS_CHUNK * self._max_concurrency
        while pos < n:
            chunks = [
                slice(s, min(s + _EXISTS_CHUNK, n)) for s in range(pos, min(pos + wave, n), _EXISTS_CHUNK)
            ]
            outcomes = await self._workers.read(
                [(keys[c], None) for c in chunks],
                root=self._root,
                suffix=SUFFIX,
                namespace_digest=self._namespace,
                nowait=0,
            )
            for chunk, (codes, _, errors) in zip(chunks, outcomes, strict=True):
                present = codes.count(native.HIT)  # a prefix: the stat stops at the first miss
                if present == chunk.stop - chunk.start:
                    continue
                end = chunk.start + present
                if codes[present] == native.ERROR:
                    self._stats.errors += 1
                    raise self._files.stat_failure(keys[end], errors[0][1])
                if codes[present] == native.RETRY:
                    self._files.log_not_a_page(keys[end])
                return end
            pos = chunks[-1].stop
        return n

    async def get(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[PageStatus]:
        """Read pages straight into `buffers`; one `PageStatus` per page, `HIT` only for a verified page.

        A page that is truncated, overlong, of another length, has a bad header or fails its checksum
        (`CORRUPT`), names another namespace or key in its header (`FOREIGN`: a page copied, renamed or
        symlinked over this key), or is of an older format (`OLD_FORMAT`) is logged at warning level and
        counted in `statistics()`.

        When this returns normally, no thread writes into any buffer any more. When it raises (cancelled,
        or a group refused after others were queued), a group not started yet never starts, but a group
        already being read, or the worker thread re-reading flagged pages, keeps writing into its buffers
        until its read returns (a hung mount: maybe never); those buffers are registered in
        `storage_backends.threads.stray_threads` meanwhile, and the caller must not reuse one while
        `stray_threads.busy([buffer])` is true (the protocol's rule); every other buffer is quiet.

        Raises:
            CacheClosed: after `aclose()`.
            ValueError: naming `keys` for a malformed key, or `buffers` for a length mismatch with
                `keys`, a non-contiguous or a read-only buffer.
        """
        check_batch(keys, buffers)
        validate_keys(keys)
        return self._stats.record_reads(await self._read(keys, buffers), buffers)

    async def put(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[bool]:
        """Write pages from `buffers`: a group file per worker-thread share (up to `group_bytes`), written
        whole under a temporary name, then a hard link per page (a name already there is replaced); one flag
        per page.

        A page that cannot be written (disk full, permissions) is logged, counted in
        `statistics().errors` and reported `False`; no temporary file is left behind.

        Raises:
            CacheClosed: after `aclose()`.
            ValueError: naming `keys` or `buffers`, as for `get`.
        """
        check_batch(keys, buffers)
        validate_keys(keys)
        return self._stats.record_writes(await self._gather_groups(self._write_group, keys, buffers), buffers)

    async def delete(self, keys: Sequence[str]) -> None:
        """Remove pages (their names; a group file goes with its last name); absent keys are ignored.

        Raises:
            CacheClosed: after `aclose()`.
            ValueError: naming `keys`, for a malformed key.
            StorageError: if a file exists but cannot be removed.
        """
        validate_keys(keys)
        chunks = [slice(s, s + _EXISTS_CHUNK) for s in range(0, len(keys), _EXISTS_CHUNK)]
        await self._workers.calls(
            [partial(self._files.delete_group, keys[c]) for c in chunks], [()] * len(chunks)
        )

    def __repr__(self) -> str:
        s = self._stats
        state = "closed" if self._closed else "open"
        return (
            f"<FileBackend {state} root={self._root!r} namespace={self._namespace.hex()[:8]}… "
            f"max_concurrency={self._max_concurrency} durable={self._durable} "
            f"read={s.pages_read} written={s.pages_written} misses={s.misses} "
            f"checksum_failures={s.checksum_failures} foreign={s.foreign_pages} "
            f"old_format={s.old_format_pages} errors={s.errors}>"
        )

    # -- internals ------------------------------------------------------------------------------------

    def _path(self, key: str) -> str:
        return self._files.path(key)

    async def _gather_groups(
        self,
        func: Callable[[Sequence[str], Sequence[memoryview]], list[PageStatus]],
        keys: Sequence[str],
        buffers: Sequence[memoryview],
    ) -> list[PageStatus]:
        return await gather_page_groups(
            func,
            keys,
            buffers,
            workers=self._workers,
            group_bytes=self._group_bytes,
            min_group_bytes=_MIN_GROUP_BYTES,
        )

    async def _read(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[PageStatus]:
        """Read and verify pages in the worker threads, a group per job; re-read checked (in one more job)
        the pages the C reader flagged."""
        groups = group_slices(
            buffer_sizes(buffers),
            limit=self._workers.unclaimed,
            group_bytes=self._group_bytes,
            min_group_bytes=_MIN_GROUP_BYTES,
        )
        outcomes = await self._workers.read(
            [(keys[g], buffers[g]) for g in groups],
            root=self._root,
            suffix=SUFFIX,
            namespace_digest=self._namespace,
            nowait=self._files.read_flags,
            hook=self._before_read,
        )
        statuses: list[PageStatus | None] = []
        for g, (codes, flags, errors) in zip(groups, outcomes, strict=True):
            statuses += self._files.statuses(keys[g], codes, flags, errors)
        if None in statuses:
            again = [i for i, status in enumerate(statuses) if status is None]
            flagged = [buffers[i] for i in again]
            rechecked = await self._workers.call(
                self._files.recheck, [keys[i] for i in again], flagged, touches=flagged
            )
            for i, status in zip(again, rechecked, strict=True):
                statuses[i] = status
        return statuses  # type: ignore[return-value]  # every None was replaced above

    def _release(self) -> None:
        self._workers.close()

    def _write_group(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[PageStatus]:
        """Write a group of pages in a worker thread (`PageFiles.write_group`)."""
        return self._files.write_group(keys, buffers)
