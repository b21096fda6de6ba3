"""A storage backend on a local or mounted filesystem: one file per page, written atomically.

Layout: `root/ab/cd/<key>.kvp`, where `ab` and `cd` are the key's first two hex pairs, so no directory
grows past 65536 entries per level. Every file is a `page_format` header followed by the payload.

Reads go straight into the caller's buffer with `os.preadv` (header and payload in one system call) and
are verified in the same worker thread; writes go to a temporary file in the page's directory and are
renamed over the final name with `os.replace`, so a reader sees a whole page or no page.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import struct
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anyio
import xxhash

from hicache.errors import ChecksumMismatch, StorageError
from storage_backends.batching import (
    CORRUPT,
    ERROR,
    HIT,
    MISS,
    BackendStatistics,
    PendingGroups,
    StatisticsRecorder,
    check_batch,
    gather_bounded,
    gather_page_groups,
    run_in_thread,
)
from storage_backends.lifecycle import BackendLifecycle
from storage_backends.names import file_root_from_url_path
from storage_backends.page_format import (
    FORMAT_VERSION,
    HEADER_SIZE,
    MAGIC,
    check_namespace_digest,
    check_stored_size,
    encode_header,
    failure_status,
    key_digest,
    validate_keys,
    verify_page,
)
from storage_backends.protocol import PageStatus
from storage_backends.redact import redact_url

__all__ = ["FileBackend", "default_concurrency"]

log = logging.getLogger(__name__)

SUFFIX = ".kvp"
"""File name suffix of a stored page."""

_TMP_SUFFIX = ".tmp"
_O_READ = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
_O_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)

_HEADER_FIELDS = struct.Struct("<4sBBH16s16sQQ")
"""The `page_format` header layout, unpacked inline on the read fast path."""
assert _HEADER_FIELDS.size == HEADER_SIZE

_NOWAIT: int = getattr(os, "RWF_NOWAIT", 0) if hasattr(os, "posix_fadvise") else 0
"""`preadv` flag: fail with EAGAIN instead of waiting for the device (Linux >= 4.14); 0 where absent."""
_WILLNEED: int = getattr(os, "POSIX_FADV_WILLNEED", 0)
_WOULD_BLOCK = None
"""Internal outcome of a `RWF_NOWAIT` read: the page is not (wholly) in the page cache."""

_GROUP_BYTES = 4 << 20
"""Target payload bytes per worker-thread call. Measured with `bench/bench_io.py` (2 cores, hot cache):
1 MiB groups reached ~0.63 of raw preadv at 1 MiB pages and ~0.66 at 64 KiB; 4 MiB groups ~1.0 and ~0.76;
16 MiB gained little more and makes a cancelled get wait longer for its threads."""

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

    Safe to share a root between processes: writes are atomic renames and every read is verified.

    Args:
        root: the directory holding the pages; created if missing. A filesystem path, made absolute and
            normalised (`os.path.abspath`: `..` is resolved); `from_url` refuses `.` and `..` instead.
        namespace_digest: the 16-byte namespace digest written into, and required from, every page.
        max_concurrency: the most worker threads this backend keeps busy at once, across all calls
            (default: `default_concurrency()`).
        durable: fsync each page and its directory before reporting it written.
        group_bytes: payload bytes one worker-thread call handles; small pages are grouped up to this
            size so a thread hop is shared by several pages.
        readahead: when a page of a group is not in the page cache, open the rest of the group and
            advise the kernel to read them all ahead (`posix_fadvise(WILLNEED)`), so cold reads reach
            the device together; pages in the page cache are read as usual. Needs Linux (`RWF_NOWAIT`);
            ignored elsewhere.

    Raises:
        ValueError: for a bad `namespace_digest` or `max_concurrency` < 1.
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
        self._nowait = _NOWAIT if readahead else 0
        self._limiter = anyio.CapacityLimiter(max_concurrency)
        self._pending = PendingGroups()
        self._stats = StatisticsRecorder()
        self._known_dirs: set[str] = set()
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
        """The file that holds page `key` (validated: it never leaves the root).

        Raises:
            ValueError: naming `keys`, if `key` is not 4-128 lowercase hex characters.
        """
        validate_keys([key])
        return Path(self._path(key))

    def statistics(self) -> BackendStatistics:
        """Counters since the backend was opened."""
        return self._stats.snapshot()

    # -- the protocol ---------------------------------------------------------------------------------

    async def exists(self, keys: Sequence[str]) -> int:
        """Length of the longest prefix of `keys` whose page files all exist (stops at the first miss).

        Keys are stat-ed in chunks, up to `max_concurrency` chunks at once; a wave of chunks runs only if
        every page before it exists.

        Raises:
            CacheClosed: after `aclose()`.
            ValueError: naming `keys`, for a malformed key.
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
            counts = await gather_bounded(
                [partial(run_in_thread, self._count_present, keys[c], limiter=self._limiter) for c in chunks],
                self._max_concurrency,
            )
            for chunk, count in zip(chunks, counts, strict=True):
                if count < chunk.stop - chunk.start:
                    return chunk.start + count
            pos = chunks[-1].stop
        return n

    async def get(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[PageStatus]:
        """Read pages straight into `buffers`; one `PageStatus` per page, `HIT` only for a verified page.

        A page that is truncated, has a bad header or fails its checksum (`CORRUPT`), names another
        namespace or key in its header (`FOREIGN`: a page copied, renamed or symlinked over this key), or is
        of an older format (`OLD_FORMAT`) is logged at warning level and counted in `statistics()`.
        When this returns, normally or not, no thread is still writing into any buffer.

        Raises:
            CacheClosed: after `aclose()`.
            ValueError: naming `keys` for a malformed key, or `buffers` for a length mismatch with
                `keys`, a non-contiguous buffer, or a buffer whose size differs from a stored page.
        """
        check_batch(keys, buffers)
        validate_keys(keys)
        return self._stats.record_reads(await self._gather_groups(self._read_group, keys, buffers), buffers)

    async def put(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[bool]:
        """Write pages from `buffers`, each atomically (temporary file + rename); one flag per page.

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
        """Remove pages; absent keys are ignored.

        Raises:
            CacheClosed: after `aclose()`.
            ValueError: naming `keys`, for a malformed key.
            StorageError: if a file exists but cannot be removed.
        """
        validate_keys(keys)
        chunks = [slice(s, s + _EXISTS_CHUNK) for s in range(0, len(keys), _EXISTS_CHUNK)]
        await gather_bounded(
            [partial(run_in_thread, self._delete_group, keys[c], limiter=self._limiter) for c in chunks],
            self._max_concurrency,
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
        return f"{self._root}/{key[0:2]}/{key[2:4]}/{key}{SUFFIX}"

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
            limiter=self._limiter,
            group_bytes=self._group_bytes,
            min_group_bytes=_MIN_GROUP_BYTES,
            pending=self._pending,
        )

    def _read_group(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[PageStatus]:
        """Read and verify a group of pages in a worker thread; one outcome code per page.

        Pages are read with `RWF_NOWAIT` while the page cache holds them: one system call each, as fast
        as a plain read. The first page that would wait for the device switches the rest of the group to
        `_read_group_ahead`, which asks the kernel for all of them at once before reading.
        """
        out: list[PageStatus] = []
        for i, (key, buf) in enumerate(zip(keys, buffers, strict=True)):
            code = self._read_one(key, buf, self._nowait)
            if code is None:  # _WOULD_BLOCK
                out.extend(self._read_group_ahead(keys[i:], buffers[i:]))
                break
            out.append(code)
        return out

    def _read_group_ahead(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[PageStatus]:
        """Open every page, advise the kernel to read them all ahead (`WILLNEED`), then read each.

        A cold group then keeps the device busy with the whole group's reads at once instead of one
        page at a time per thread (measured with `bench/bench_io.py`: 64 KiB pages, 4 threads, cold
        cache, 0.95 -> 1.5 GB/s). On a hot cache the advice costs ~15%, hence the `RWF_NOWAIT` probe.
        """
        fds: list[int] = []
        try:
            for key, buf in zip(keys, buffers, strict=True):
                try:
                    fd = os.open(self._path(key), _O_READ)
                except OSError:
                    fd = -1  # _read_one opens it again and reports the failure
                else:
                    with contextlib.suppress(OSError):
                        os.posix_fadvise(fd, 0, HEADER_SIZE + buf.nbytes, _WILLNEED)
                fds.append(fd)
            out: list[PageStatus] = []
            for key, buf, fd in zip(keys, buffers, fds, strict=True):
                code = self._read_one(key, buf, 0, fd)
                assert code is not None, "a read without RWF_NOWAIT never reports would-block"
                out.append(code)
            return out
        finally:
            for fd in fds:
                if fd >= 0:
                    os.close(fd)

    def _read_one(self, key: str, buf: memoryview, flags: int = 0, fd: int = -1) -> PageStatus | None:
        """Read and verify one page in a worker thread; return its outcome code.

        With `flags` = `RWF_NOWAIT`, returns `_WOULD_BLOCK` instead of waiting for the device. Reads
        from `fd` when one is given (the caller closes it), else opens and closes the page file.
        """
        if fd >= 0:
            return self._read_fd(key, buf, fd, flags)
        try:
            fd = os.open(self._path(key), _O_READ)
        except FileNotFoundError:
            return MISS
        except OSError as exc:
            log.warning("cannot open page %s: %s", self._path(key), exc)
            return ERROR
        try:
            return self._read_fd(key, buf, fd, flags)
        finally:
            os.close(fd)

    def _read_fd(self, key: str, buf: memoryview, fd: int, flags: int) -> PageStatus | None:
        header = bytearray(HEADER_SIZE)
        want = HEADER_SIZE + buf.nbytes
        try:
            got = os.preadv(fd, [header, buf], 0, flags)
        except BlockingIOError:
            return _WOULD_BLOCK
        except OSError as exc:
            if flags and exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                self._nowait = 0  # this filesystem cannot tell: read plainly from now on
                return _WOULD_BLOCK
            log.warning("cannot read page %s: %s", self._path(key), exc)
            return ERROR
        if got == want:
            # The common case in one unpack and one hash; anything unusual takes the checked path below.
            magic, version, page_flags, reserved, digest, kdigest, length, checksum = _HEADER_FIELDS.unpack(
                header
            )
            if (
                magic == MAGIC
                and version == FORMAT_VERSION
                and not page_flags
                and not reserved
                and digest == self._namespace
                and kdigest == key_digest(key)
                and length == got - HEADER_SIZE
            ):
                if xxhash.xxh3_64_intdigest(buf) == checksum:
                    return HIT
                log.warning(
                    "discarding page %s: page checksum mismatch: stored %016x", self._path(key), checksum
                )
                return CORRUPT
        elif flags:
            return _WOULD_BLOCK  # partly cached, or truncated: the blocking read decides
        return self._read_slow(key, buf, fd, header, got)

    def _read_slow(self, key: str, buf: memoryview, fd: int, header: bytearray, got: int) -> PageStatus:
        """Finish a short read and verify the page field by field, naming the first problem."""
        path = self._path(key)
        want = HEADER_SIZE + buf.nbytes
        try:
            if 0 < got < want:
                got = _finish_read(fd, header, buf, got)
            size = os.fstat(fd).st_size
        except OSError as exc:
            log.warning("cannot read page %s: %s", path, exc)
            return ERROR
        try:
            # Three cases: a page of another size (foreign, truncated, overlong, or the caller's buffer
            # is wrong: `check_stored_size` tells them apart), or one of the right size that must verify.
            check_stored_size(
                memoryview(header)[: min(got, HEADER_SIZE)], size, buf.nbytes, self._namespace, key
            )
            verify_page(header, buf, self._namespace, key)
        except ChecksumMismatch as exc:
            log.warning("discarding page %s: %s", path, exc)
            return failure_status(exc)
        return HIT

    def _write_group(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[PageStatus]:
        return [self._write_one(key, buf) for key, buf in zip(keys, buffers, strict=True)]

    def _write_one(self, key: str, buf: memoryview) -> PageStatus:
        """Write one page atomically in a worker thread; return its outcome code."""
        directory = f"{self._root}/{key[0:2]}/{key[2:4]}"
        path = f"{directory}/{key}{SUFFIX}"
        tmp = f"{directory}/.{key}.{secrets.token_hex(8)}{_TMP_SUFFIX}"
        try:
            header = encode_header(buf, self._namespace, key)
            if directory not in self._known_dirs:
                os.makedirs(directory, exist_ok=True)
                self._known_dirs.add(directory)
            try:
                fd = os.open(tmp, _O_CREATE, 0o644)
            except FileNotFoundError:  # the directory was removed behind our back: recreate it once
                os.makedirs(directory, exist_ok=True)
                fd = os.open(tmp, _O_CREATE, 0o644)
            try:
                try:
                    _write_all(fd, header, buf)
                    if self._durable:
                        os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, path)
            except BaseException:
                _unlink_quietly(tmp)
                raise
            if self._durable:
                _fsync_dir(directory)
        except OSError as exc:
            log.warning("cannot write page %s: %s", path, exc)
            return ERROR
        return HIT

    def _count_present(self, keys: Sequence[str]) -> int:
        for i, key in enumerate(keys):
            try:
                os.stat(self._path(key))
            except FileNotFoundError:
                return i
            except OSError as exc:
                log.warning("cannot stat page %s: %s", key, exc)
                return i
        return len(keys)

    def _delete_group(self, keys: Sequence[str]) -> None:
        for key in keys:
            try:
                os.unlink(self._path(key))
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise StorageError(f"cannot delete page {key}: {exc}") from exc


def _finish_read(fd: int, header: bytearray, buf: memoryview, got: int) -> int:
    """Continue a short `preadv` until the page is complete or the file ends (FUSE may split reads)."""
    want = HEADER_SIZE + buf.nbytes
    hview = memoryview(header)
    bview = buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf
    while got < want:
        if got < HEADER_SIZE:
            n = os.preadv(fd, [hview[got:], bview], got)
        else:
            n = os.preadv(fd, [bview[got - HEADER_SIZE :]], got)
        if n == 0:
            break
        got += n
    return got


def _write_all(fd: int, header: bytes, buf: memoryview) -> None:
    """Write header and payload fully, continuing after short writes."""
    total = HEADER_SIZE + buf.nbytes
    done = os.writev(fd, [header, buf])
    if done == total:
        return
    data = buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf
    while done < total:
        if done < HEADER_SIZE:
            done += os.writev(fd, [header[done:], data])
        else:
            done += os.write(fd, data[done - HEADER_SIZE :])


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
